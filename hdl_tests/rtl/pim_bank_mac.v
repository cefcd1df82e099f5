// pim_bank_mac: one HBM-PIM / AttAcc-style bank MAC unit running a GEMV y = W x from its bank.
//
// LANES fp16 lanes beside one DRAM bank. W [N, K] lies in the bank row-major and contiguous:
// lanes-wide column c of W row n is bank column g = n * k_cols + c (k_cols = K / LANES), at DRAM
// row g / COLS_PER_ROW, column g % COLS_PER_ROW. x [K] is loaded beforehand into the unit's
// register file (XCOLS registers of LANES fp16). accel_model/pim_mac.py is the model: its
// `command_trace` lists every command and output this RTL produces, cycle by cycle.
//
// The bank is behavioural and outside: the bench's bank model sees the commands on cmd_* and,
// for a RD shown in cycle e (registered at edge e), drives that column's LANES fp16 words on
// col_data during cycle e + 1; the unit registers them at edge e + 2. Commands are one-cycle pulses.
//
// Interface contract (edge 0 = the edge that accepts start):
//   * start is accepted when busy is low, 1 <= n_rows, 1 <= k_cols <= XCOLS; the bank must be
//     precharged (no row open) and tRP must have passed since its last PRE. x register r holds
//     x[r*LANES +: LANES] (loaded with x_we / x_addr / x_data while idle, lane j in bits 16j+15:16j).
//   * ACT row 0 at cycle 0; RD tRCD after an ACT, then every TCCD along the row; after a row's last
//     column, PRE one TCCD slot after that RD, ACT TRP later; after the job's last RD (cycle
//     last_rd), a closing PRE at last_rd + TCCD.
//   * Datapath: edge e+2 data and x registers, e+3 exact fp16 x fp16 -> fp32 products, e+4 per-lane
//     fp32 accumulate (RNE; the first column of an output loads the product), then log2(LANES)
//     registered levels of a pairwise fp32 adder tree (lanes 0+1, 2+3, ...; then pairs of those).
//     y_valid pulses with y_data (fp32) and y_idx = n at last_rd(n) + 4 + log2(LANES).
//   * done pulses, busy falls, in the job's last cycle: the later of the last y and the cycle
//     before tRP has passed since the closing PRE (so a start in the done cycle meets tRP):
//     start -> done = last_rd + max(TCCD + TRP, 5 + log2(LANES)) cycles, inclusive.
//
// FAULT (bench teeth only): 1 = row-switch PRE -> ACT one cycle short (TRP - 1, needs TRP >= 2);
// 2 = the accumulator rounds toward zero instead of to nearest even (the rounding error of each
// add is found exactly with TwoSum, and a sum rounded away from zero steps back one ulp).
`default_nettype none

module pim_bank_mac #(
    parameter integer LANES        = 16,  // 2, 4, 8 or 16
    parameter integer TCCD         = 4,   // cycles between column commands (tCCD_L)
    parameter integer TRCD         = 17,  // ACT -> RD
    parameter integer TRP          = 17,  // PRE -> ACT
    parameter integer COLS_PER_ROW = 32,  // LANES-wide columns per DRAM row
    parameter integer XCOLS        = 8,   // x register file depth (LANES fp16 each)
    parameter integer FAULT        = 0
) (
    input  wire                  clk,
    input  wire                  rst,
    input  wire                  x_we,
    input  wire [          15:0] x_addr,
    input  wire [  LANES*16-1:0] x_data,
    input  wire                  start,
    input  wire [          15:0] n_rows,
    input  wire [          15:0] k_cols,
    output reg                   busy,
    output reg                   done,
    output reg                   cmd_act,
    output reg                   cmd_rd,
    output reg                   cmd_pre,
    output reg  [          15:0] cmd_row,
    output reg  [          15:0] cmd_col,
    input  wire [  LANES*16-1:0] col_data,
    output wire                  y_valid,
    output wire [          15:0] y_idx,
    output wire [          31:0] y_data
);
  localparam integer LOG = $clog2(LANES);  // adder tree levels
  localparam integer XA = (XCOLS > 1) ? $clog2(XCOLS) : 1;
  localparam [31:0] WAIT_RCD = TRCD - 1;
  localparam [31:0] WAIT_CCD = TCCD - 1;
  // FAULT 1: the row switch waits one cycle less than tRP between PRE and ACT.
  localparam [31:0] WAIT_RP_SW = TRP - 1 - ((FAULT == 1) ? 1 : 0);
  localparam [31:0] WAIT_RP_END = (TRP > 1) ? TRP - 2 : 0;
  localparam [31:0] LAST_COL32 = COLS_PER_ROW - 1;  // 32-bit constants, used as [15:0] (Python checks range)
  localparam [31:0] XCOLS32 = XCOLS;
  localparam [15:0] LAST_COL = LAST_COL32[15:0];
  localparam [15:0] XCOLS16 = XCOLS32[15:0];

  // ---- activation register file --------------------------------------------------------------
  reg [LANES*16-1:0] xrf[0:XCOLS-1];
  always @(posedge clk) if (x_we && !busy && x_addr < XCOLS16) xrf[x_addr[XA-1:0]] <= x_data;

  // ---- command sequencer ---------------------------------------------------------------------
  localparam [2:0] S_IDLE = 3'd0, S_RD = 3'd1, S_SW_PRE = 3'd2, S_SW_ACT = 3'd3;
  localparam [2:0] S_END_PRE = 3'd4, S_CLOSING = 3'd5, S_DRAIN = 3'd6;
  reg [2:0] state;
  reg [31:0] timer;  // cycles left before the state's command; issue when 0
  reg [15:0] row, col;  // DRAM row open, next column in it
  reg [15:0] cidx, nidx;  // next W column within its output row, output index
  reg [15:0] kc, nr;  // job size latched at start
  reg mem_fin_r, dp_fin_r;  // sticky: bank closed / last y out
  wire accept = start && !busy && (n_rows != 16'd0) && (k_cols != 16'd0) && (k_cols <= XCOLS16);
  wire olast = cidx == kc - 16'd1;  // this RD is an output row's last column
  wire jlast = olast && (nidx == nr - 16'd1);  // ... and the job's last column
  // The closing PRE's tRP ends after this edge (TRP == 1: the PRE's own edge).
  wire mem_fin_now = ((state == S_END_PRE) && (timer == 32'd0) && (TRP == 1)) ||
      ((state == S_CLOSING) && (timer == 32'd0));
  wire dp_fin_now;  // the job's last y is registered at this edge (from the tree below)

  // RD tags, registered with cmd_rd (stage 0) and carried along the datapath.
  reg v0, first0, olast0, jlast0;
  reg [XA-1:0] xc0;
  reg [15:0] n0;

  always @(posedge clk) begin
    if (rst) begin
      state <= S_IDLE;
      timer <= 32'd0;
      {row, col, cidx, nidx, kc, nr} <= {6{16'd0}};
      {busy, done, cmd_act, cmd_rd, cmd_pre, mem_fin_r, dp_fin_r} <= 7'd0;
      {cmd_row, cmd_col} <= 32'd0;
      {v0, first0, olast0, jlast0} <= 4'd0;
      xc0 <= {XA{1'b0}};
      n0 <= 16'd0;
    end else begin
      {done, cmd_act, cmd_rd, cmd_pre, v0} <= 5'd0;
      if (timer != 32'd0) timer <= timer - 32'd1;
      case (state)
        S_IDLE:
        if (accept) begin
          busy <= 1'b1;
          cmd_act <= 1'b1;
          cmd_row <= 16'd0;
          {row, col, cidx, nidx} <= {4{16'd0}};
          kc <= k_cols;
          nr <= n_rows;
          {mem_fin_r, dp_fin_r} <= 2'b00;
          timer <= WAIT_RCD;
          state <= S_RD;
        end
        S_RD:
        if (timer == 32'd0) begin
          cmd_rd <= 1'b1;
          cmd_row <= row;
          cmd_col <= col;
          {v0, first0, olast0, jlast0} <= {1'b1, cidx == 16'd0, olast, jlast};
          xc0 <= cidx[XA-1:0];
          n0 <= nidx;
          cidx <= olast ? 16'd0 : cidx + 16'd1;
          if (olast) nidx <= nidx + 16'd1;
          timer <= WAIT_CCD;
          if (jlast) state <= S_END_PRE;
          else if (col == LAST_COL) state <= S_SW_PRE;
          else col <= col + 16'd1;
        end
        S_SW_PRE:
        if (timer == 32'd0) begin
          cmd_pre <= 1'b1;
          cmd_row <= row;
          timer <= WAIT_RP_SW;
          state <= S_SW_ACT;
        end
        S_SW_ACT:
        if (timer == 32'd0) begin
          cmd_act <= 1'b1;
          cmd_row <= row + 16'd1;
          row <= row + 16'd1;
          col <= 16'd0;
          timer <= WAIT_RCD;
          state <= S_RD;
        end
        S_END_PRE:
        if (timer == 32'd0) begin
          cmd_pre <= 1'b1;
          cmd_row <= row;
          timer <= WAIT_RP_END;
          state <= (TRP == 1) ? S_DRAIN : S_CLOSING;
        end
        S_CLOSING: if (timer == 32'd0) state <= S_DRAIN;
        default: ;  // S_DRAIN: wait for the last y
      endcase
      if (busy) begin
        if ((mem_fin_now || mem_fin_r) && (dp_fin_now || dp_fin_r)) begin
          done  <= 1'b1;
          busy  <= 1'b0;
          state <= S_IDLE;
        end else begin
          mem_fin_r <= mem_fin_r || mem_fin_now;
          dp_fin_r  <= dp_fin_r || dp_fin_now;
        end
      end
    end
  end

  // ---- datapath: tags through stages 1..4 --------------------------------------------------------
  reg v1, first1, olast1, jlast1, v2, first2, olast2, jlast2, v3, first3, olast3, jlast3;
  reg [XA-1:0] xc1;
  reg [15:0] n1, n2, n3;
  reg [LANES*16-1:0] w_r, x_r;
  always @(posedge clk) begin
    if (rst) begin
      {v1, first1, olast1, jlast1, v2, first2, olast2, jlast2, v3, first3, olast3, jlast3} <= 12'd0;
      xc1 <= {XA{1'b0}};
      {n1, n2, n3} <= 48'd0;
      w_r <= {LANES * 16{1'b0}};
      x_r <= {LANES * 16{1'b0}};
    end else begin
      {v1, first1, olast1, jlast1, xc1, n1} <= {v0, first0, olast0, jlast0, xc0, n0};
      {v2, first2, olast2, jlast2, n2} <= {v1, first1, olast1, jlast1, n1};
      {v3, first3, olast3, jlast3, n3} <= {v2, first2, olast2, jlast2, n2};
      if (v1) begin  // the column is on col_data during this cycle (cycle e + 1)
        w_r <= col_data;
        x_r <= xrf[xc1];
      end
    end
  end

  // Tree nodes in one vector: nodes 0 .. LANES-1 are the accumulators (level 0); level l >= 1
  // starts at node 2*LANES - (2*LANES >> l) and its node i adds level l-1's nodes 2i and 2i+1.
  wire [(2*LANES-1)*32-1:0] node;
  reg [LOG:0] lv, lj;  // per level: valid, job-last
  reg [16*(LOG+1)-1:0] ln;  // per level: output index

  genvar j, l, i;
  generate
    for (j = 0; j < LANES; j = j + 1) begin : g_lane
      wire [31:0] prod, sum, acc_next;
      reg  [31:0] p_r, acc;
      fp16_mul_fp32 u_mul (
          .a(w_r[16*j+:16]),
          .b(x_r[16*j+:16]),
          .y(prod)
      );
      fp32_add u_acc (
          .a(acc),
          .b(p_r),
          .y(sum)
      );
      if (FAULT == 2) begin : g_rtz
        // TwoSum (Knuth): t = (acc + p_r) - sum exactly; sum was rounded away from zero when t is
        // nonzero with the opposite sign; truncation then steps its magnitude down one ulp.
        wire [31:0] a1, b1, da, db, t;
        fp32_add u_a1 (.a(sum), .b({~p_r[31], p_r[30:0]}), .y(a1));
        fp32_add u_b1 (.a(sum), .b({~a1[31], a1[30:0]}), .y(b1));
        fp32_add u_da (.a(acc), .b({~a1[31], a1[30:0]}), .y(da));
        fp32_add u_db (.a(p_r), .b({~b1[31], b1[30:0]}), .y(db));
        fp32_add u_t (.a(da), .b(db), .y(t));
        assign acc_next = ((t[30:0] != 31'd0) && (t[31] != sum[31])) ? sum - 32'd1 : sum;
      end else begin : g_rne
        assign acc_next = sum;
      end
      always @(posedge clk) begin
        if (rst) begin
          p_r <= 32'd0;
          acc <= 32'd0;
        end else begin
          p_r <= prod;
          if (v3) acc <= first3 ? p_r : acc_next;
        end
      end
      assign node[32*j+:32] = acc;
    end

    for (l = 1; l <= LOG; l = l + 1) begin : g_level
      localparam integer BASE = 2 * LANES - ((2 * LANES) >> l);
      localparam integer PREV = 2 * LANES - ((2 * LANES) >> (l - 1));
      for (i = 0; i < (LANES >> l); i = i + 1) begin : g_node
        wire [31:0] s;
        reg  [31:0] r;
        fp32_add u_add (
            .a(node[32*(PREV+2*i)+:32]),
            .b(node[32*(PREV+2*i+1)+:32]),
            .y(s)
        );
        always @(posedge clk) begin
          if (rst) r <= 32'd0;
          else if (lv[l-1]) r <= s;
        end
        assign node[32*(BASE+i)+:32] = r;
      end
    end
  endgenerate

  // Level 0 is valid the cycle after an output row's last accumulate.
  always @(posedge clk) begin
    if (rst) begin
      lv <= {(LOG + 1) {1'b0}};
      lj <= {(LOG + 1) {1'b0}};
      ln <= {16 * (LOG + 1) {1'b0}};
    end else begin
      lv <= {lv[LOG-1:0], v3 && olast3};
      lj <= {lj[LOG-1:0], v3 && jlast3};
      ln <= {ln[16*LOG-1:0], n3};
    end
  end

  assign dp_fin_now = lv[LOG-1] && lj[LOG-1];
  assign y_valid = lv[LOG];
  assign y_idx = ln[16*LOG+:16];
  assign y_data = node[32*(2*LANES-2)+:32];
endmodule

`default_nettype wire
