// systolic_ws: ROWS x COLS int8 weight-stationary systolic array with its control.
//
// One job computes C[M][COLS] = A[M][ROWS] * B[ROWS][COLS] (int8 x int8 -> int32):
// B is loaded into the array, A streams through it; M = t_len (1 .. 2^T_W - 1).
//
// Interface contract (no back-pressure, like a stall-free SCALE-Sim fold):
//   * `start` is accepted on a clock edge where busy is low and t_len != 0; call
//     that edge 0. Weight row k (b_vec = row k of B) must be on the inputs at edge
//     k, k = 0..R-1; activation row m (a_vec = row m of A, element r in bits
//     [8r+7:8r]) at edge R+m, m = 0..M-1. Inputs outside those windows are ignored.
//   * Edge k registers weight row k (input stage); edge k+1 writes it into PE row k,
//     so the array holds B after edge R (SCALE-Sim's R weight-load cycles).
//   * Activation row m is registered at edge R+m; element r passes r more skew
//     registers and meets PE(r,c) at edge R+m+r+c+1. Partial sums move down, so
//     column c of output row m leaves the bottom row after edge 2R+m+c; a de-skew of
//     C-1-c registers aligns the row after edge 2R+C-1+m. The last one (m = M-1) is
//     at edge 2R+C+M-2 = SCALE-Sim's weight-stationary fold (2R+C+M-2 cycles,
//     edges 1..2R+C+M-2).
//   * Row m is registered onto out_data (out_valid, out_row = m) at edge 2R+C+m; the
//     last row leaves at edge 2R+C+M-1 with a one-cycle `done` pulse.
//   * So start->done = 2R+C+M cycles = fold + 1 (input register) + 1 (readout
//     register); accel_model/systolic_control.py says so.
//
// FAULT (bench teeth only): 1 = drain counter off by one (rows read a cycle early),
// 2 = wrong accumulate (see sa_pe_ws).
`default_nettype none

module systolic_ws #(
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
  reg  [31:0] m_len;  // M of the running job
  wire        wfeed = accept || (busy && ecnt < ROWS);
  wire [31:0] wrow = accept ? 32'd0 : ecnt;
  wire        afeed = busy && (ecnt >= ROWS) && (ecnt < ROWS + m_len);
  // Output row m is read at edge 2R + C + m (FAULT 1 reads one edge early).
  wire [31:0] rd_base = 2 * ROWS + COLS - ((FAULT == 1) ? 32'd1 : 32'd0);
  wire        rd_now = busy && (ecnt >= rd_base);
  wire [31:0] rd_row = ecnt - rd_base;

  // ---- input register (zeroes outside the feed windows keep X out) ---------
  reg [ROWS*8-1:0] a_r;
  reg              av_r;
  reg [COLS*8-1:0] b_r;
  reg              wv_r;
  reg [31:0]       wrow_r;
  always @(posedge clk) begin
    if (rst) begin
      a_r    <= {ROWS * 8{1'b0}};
      av_r   <= 1'b0;
      b_r    <= {COLS * 8{1'b0}};
      wv_r   <= 1'b0;
      wrow_r <= 32'd0;
    end else begin
      a_r    <= afeed ? a_vec : {ROWS * 8{1'b0}};
      av_r   <= afeed;
      b_r    <= wfeed ? b_vec : {COLS * 8{1'b0}};
      wv_r   <= wfeed;
      wrow_r <= wrow;
    end
  end

  // ---- skew, PE grid, de-skew -------------------------------------------------
  // Arrays of nets, one element per link: Icarus re-evaluates every reader of a net when any
  // bit changes, so one flattened grid-wide vector made an 8x8 array ~30x slower to simulate.
  // ah: A bundles {valid, a} entering PE(i,j) from the left (j = COLS: unused exit).
  // pv: partial sums entering PE(i,j) from the top (row 0 gets zeros).
  /* verilator lint_off UNUSEDSIGNAL */
  wire [ 8:0] ah[0:ROWS*(COLS+1)-1];
  /* verilator lint_on UNUSEDSIGNAL */
  wire [31:0] pv[0:(ROWS+1)*COLS-1];
  wire [31:0] aligned[0:COLS-1];

  genvar i, j;
  generate
    for (j = 0; j < COLS; j = j + 1) begin : g_top
      assign pv[j] = 32'd0;
    end
    for (i = 0; i < ROWS; i = i + 1) begin : g_askew
      delay_line #(.WIDTH(9), .DEPTH(i)) u_skew (
          .clk(clk), .rst(rst), .d({av_r, a_r[8*i+:8]}), .q(ah[i*(COLS+1)])
      );
    end
    for (i = 0; i < ROWS; i = i + 1) begin : g_row
      for (j = 0; j < COLS; j = j + 1) begin : g_col
        sa_pe_ws #(.FAULT(FAULT)) u_pe (
            .clk(clk),
            .rst(rst),
            .a_in(ah[i*(COLS+1)+j]),
            .w_in(b_r[8*j+:8]),
            .w_load(wv_r && (wrow_r == i)),
            .p_in(pv[i*COLS+j]),
            .a_out(ah[i*(COLS+1)+j+1]),
            .p_out(pv[(i+1)*COLS+j])
        );
      end
    end
    for (j = 0; j < COLS; j = j + 1) begin : g_deskew
      delay_line #(.WIDTH(32), .DEPTH(COLS - 1 - j)) u_deskew (
          .clk(clk), .rst(rst), .d(pv[ROWS*COLS+j]), .q(aligned[j])
      );
    end
  endgenerate

  integer c;

  // ---- readout: one output row per cycle ---------------------------------
  always @(posedge clk) begin
    if (rst) begin
      busy      <= 1'b0;
      done      <= 1'b0;
      out_valid <= 1'b0;
      out_row   <= 16'd0;
      out_data  <= {COLS * 32{1'b0}};
      ecnt      <= 32'd0;
      m_len     <= 32'd0;
    end else begin
      done      <= 1'b0;
      out_valid <= 1'b0;
      if (accept) begin
        busy  <= 1'b1;
        ecnt  <= 32'd1;
        m_len <= {{(32 - T_W) {1'b0}}, t_len};
      end else if (busy) begin
        ecnt <= ecnt + 32'd1;
        if (rd_now) begin
          out_valid <= 1'b1;
          out_row   <= rd_row[15:0];
          for (c = 0; c < COLS; c = c + 1) out_data[c*32+:32] <= aligned[c];
          if (rd_row == m_len - 32'd1) begin
            done <= 1'b1;
            busy <= 1'b0;
          end
        end
      end
    end
  end
endmodule

`default_nettype wire
