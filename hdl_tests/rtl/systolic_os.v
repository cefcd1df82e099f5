// systolic_os: ROWS x COLS int8 output-stationary systolic array with its control.
//
// One job computes C[ROWS][COLS] = A[ROWS][K] * B[K][COLS] (int8 x int8 -> int32),
// K = t_len (1 .. 2^T_W - 1), latched at start.
//
// Interface contract (no back-pressure, like a stall-free SCALE-Sim fold):
//   * `start` is accepted on a clock edge where busy is low and t_len != 0; call
//     that edge 0. Operand vector k (a_vec = column k of A, b_vec = row k of B,
//     element i in bits [8i+7:8i]) must be on the inputs at edge k, k = 0..K-1.
//     Inputs outside that window are ignored.
//   * Edge k registers vector k (the input stage). Row i of A and column j of B
//     pass i and j more skew registers, so operand k meets PE(i,j) at edge
//     i+j+k+1; the last MAC is at edge R+C+K-2 = SCALE-Sim's output-stationary fold
//     (R+C+K-2 cycles, edges 1..R+C+K-2).
//   * Row r is final after edge r+C+K-1 and is registered onto out_data (with
//     out_valid, out_row = r) at edge r+C+K: rows drain while lower rows still
//     compute. The last row leaves at edge R+C+K-1, with a one-cycle `done` pulse.
//   * So start->done = R+C+K cycles (edges 0..R+C+K-1) = fold + 1 (input
//     register) + 1 (readout register); accel_model/systolic_control.py says so.
//
// FAULT (bench teeth only): 1 = drain counter off by one (rows read a cycle early),
// 2 = wrong accumulate (see sa_pe_os).
`default_nettype none

module systolic_os #(
    parameter integer ROWS  = 4,
    parameter integer COLS  = 4,
    parameter integer T_W   = 16,
    parameter integer FAULT = 0
) (
    input  wire                 clk,
    input  wire                 rst,
    input  wire                 start,
    input  wire [      T_W-1:0] t_len,
    input  wire [   ROWS*8-1:0] a_vec,
    input  wire [   COLS*8-1:0] b_vec,
    output reg                  busy,
    output reg                  done,
    output reg                  out_valid,
    output reg  [         15:0] out_row,
    output reg  [COLS*32-1:0]   out_data
);
  // ---- control -----------------------------------------------------------
  wire        accept = start && !busy && (t_len != {T_W{1'b0}});
  reg  [31:0] ecnt;  // index of the coming edge, counted from the accepting edge 0
  reg  [31:0] k_len;  // K of the running job
  wire        feed = accept || (busy && ecnt < k_len);
  // Row r is read at edge r + COLS + K (FAULT 1 reads one edge early).
  wire [31:0] rd_base = COLS + k_len - ((FAULT == 1) ? 32'd1 : 32'd0);
  wire        rd_now = busy && (ecnt >= rd_base);
  wire [31:0] rd_row = ecnt - rd_base;

  // ---- input register (zeroes outside the feed window keep X out) ----------
  reg [ROWS*8-1:0] a_r;
  reg [COLS*8-1:0] b_r;
  reg              v_r;
  reg              f_r;
  always @(posedge clk) begin
    if (rst) begin
      a_r <= {ROWS * 8{1'b0}};
      b_r <= {COLS * 8{1'b0}};
      v_r <= 1'b0;
      f_r <= 1'b0;
    end else begin
      a_r <= feed ? a_vec : {ROWS * 8{1'b0}};
      b_r <= feed ? b_vec : {COLS * 8{1'b0}};
      v_r <= feed;
      f_r <= accept;
    end
  end

  // ---- skew, PE grid ------------------------------------------------------
  // Arrays of nets, one element per link: Icarus re-evaluates every reader of a net when any
  // bit changes, so one flattened grid-wide vector made an 8x8 array ~30x slower to simulate.
  // ah: A bundles {first, valid, a} entering PE(i,j) from the left (j = COLS: unused exit).
  // bv: B entering PE(i,j) from the top (i = ROWS: unused exit).
  /* verilator lint_off UNUSEDSIGNAL */
  wire [ 9:0] ah[0:ROWS*(COLS+1)-1];
  wire [ 7:0] bv[0:(ROWS+1)*COLS-1];
  /* verilator lint_on UNUSEDSIGNAL */
  wire [31:0] acc_w[0:ROWS*COLS-1];

  genvar i, j;
  generate
    for (i = 0; i < ROWS; i = i + 1) begin : g_askew
      delay_line #(.WIDTH(10), .DEPTH(i)) u_skew (
          .clk(clk), .rst(rst), .d({f_r, v_r, a_r[8*i+:8]}), .q(ah[i*(COLS+1)])
      );
    end
    for (j = 0; j < COLS; j = j + 1) begin : g_bskew
      delay_line #(.WIDTH(8), .DEPTH(j)) u_skew (
          .clk(clk), .rst(rst), .d(b_r[8*j+:8]), .q(bv[j])
      );
    end
    for (i = 0; i < ROWS; i = i + 1) begin : g_row
      for (j = 0; j < COLS; j = j + 1) begin : g_col
        sa_pe_os #(.FAULT(FAULT)) u_pe (
            .clk(clk),
            .rst(rst),
            .a_in(ah[i*(COLS+1)+j]),
            .b_in(bv[i*COLS+j]),
            .a_out(ah[i*(COLS+1)+j+1]),
            .b_out(bv[(i+1)*COLS+j]),
            .acc(acc_w[i*COLS+j])
        );
      end
    end
  endgenerate

  // ---- readout: one finished row per cycle -------------------------------
  integer r, c;
  always @(posedge clk) begin
    if (rst) begin
      busy      <= 1'b0;
      done      <= 1'b0;
      out_valid <= 1'b0;
      out_row   <= 16'd0;
      out_data  <= {COLS * 32{1'b0}};
      ecnt      <= 32'd0;
      k_len     <= 32'd0;
    end else begin
      done      <= 1'b0;
      out_valid <= 1'b0;
      if (accept) begin
        busy  <= 1'b1;
        ecnt  <= 32'd1;
        k_len <= {{(32 - T_W) {1'b0}}, t_len};
      end else if (busy) begin
        ecnt <= ecnt + 32'd1;
        if (rd_now) begin
          out_valid <= 1'b1;
          out_row   <= rd_row[15:0];
          for (r = 0; r < ROWS; r = r + 1)
            if (rd_row == r) for (c = 0; c < COLS; c = c + 1) out_data[c*32+:32] <= acc_w[r*COLS+c];
          if (rd_row == ROWS - 1) begin
            done <= 1'b1;
            busy <= 1'b0;
          end
        end
      end
    end
  end
endmodule

`default_nettype wire
