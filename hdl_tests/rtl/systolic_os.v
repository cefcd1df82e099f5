// systolic_os: ROWS x COLS int8 output-stationary systolic array.
// Job control and the input register are sa_job_ctrl's; this file holds the
// operand skew, the PE grid (sa_pe_os) and the out_data row select.
//
// One job computes C[ROWS][COLS] = A[ROWS][K] * B[K][COLS] (int8 x int8 -> int32),
// K = t_len (1 .. 2^T_W - 1), latched at start.
//
// Interface contract (no back-pressure, like a stall-free SCALE-Sim fold):
//   * `start` is accepted on a clock edge where busy is low and t_len != 0; call
//     that edge 0. Operand vector k (a_vec = column k of A, b_vec = row k of B,
//     element i in bits [8i+7:8i]) must be on the inputs at edge k, k = 0..K-1
//     (sa_job_ctrl's stream window). Inputs outside that window are ignored.
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
// FAULT (bench teeth only): 1 = drain counter off by one (rows read a cycle early,
// in sa_job_ctrl), 2 = wrong accumulate (see sa_pe_os).
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
    output wire                 busy,
    output wire                 done,
    output wire                 out_valid,
    output wire [         15:0] out_row,
    output reg  [COLS*32-1:0]   out_data
);
  // ---- control: operand k in the stream window (edges 0..K-1), row r read at edge C+K+r
  wire [ROWS*8-1:0] a_r;
  wire [COLS*8-1:0] b_r;
  wire              v_r, f_r, rd_now;
  wire [      31:0] rd_row;
  sa_job_ctrl #(
      .A_W(ROWS * 8), .B_W(COLS * 8), .T_W(T_W), .READ_BASE(COLS), .READ_PLUS_T(1), .N_OUT(ROWS),
      .FAULT(FAULT)
  ) u_ctrl (
      .clk(clk), .rst(rst), .start(start), .t_len(t_len), .a_vec(a_vec), .b_vec(b_vec),
      .busy(busy), .done(done), .out_valid(out_valid), .out_row(out_row),
      .a_r(a_r), .a_v(v_r), .b_r(b_r), .in_first(f_r), .rd_now(rd_now), .rd_row(rd_row)
  );

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

  // ---- readout: the finished row rd_row, one per cycle ----------------------
  integer r, c;
  always @(posedge clk) begin
    if (rst) out_data <= {COLS * 32{1'b0}};
    else if (rd_now)
      for (r = 0; r < ROWS; r = r + 1)
        if (rd_row == r) for (c = 0; c < COLS; c = c + 1) out_data[c*32+:32] <= acc_w[r*COLS+c];
  end
endmodule

`default_nettype wire
