// systolic_ws: ROWS x COLS int8 weight-stationary systolic array.
// Job control and the input register are sa_job_ctrl's; this file holds the
// weight load, the activation skew, the PE grid (sa_pe_ws) and the output de-skew.
//
// One job computes C[M][COLS] = A[M][ROWS] * B[ROWS][COLS] (int8 x int8 -> int32):
// B is loaded into the array, A streams through it; M = t_len (1 .. 2^T_W - 1).
//
// Interface contract (no back-pressure, like a stall-free SCALE-Sim fold):
//   * `start` is accepted on a clock edge where busy is low and t_len != 0; call
//     that edge 0. Weight row k (b_vec = row k of B) must be on the inputs at edge
//     k, k = 0..R-1 (sa_job_ctrl's preload window); activation row m (a_vec = row m
//     of A, element r in bits [8r+7:8r]) at edge R+m, m = 0..M-1 (its stream window).
//     Inputs outside those windows are ignored.
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
// FAULT (bench teeth only): 1 = drain counter off by one (rows read a cycle early,
// in sa_job_ctrl), 2 = wrong accumulate (see sa_pe_ws).
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
    output wire                 busy,
    output wire                 done,
    output wire                 out_valid,
    output wire [         15:0] out_row,
    output reg  [COLS*32-1:0]   out_data
);
  // ---- control: weights at edges 0..R-1, activations at R..R+M-1, row m read at 2R+C+m
  wire [ROWS*8-1:0] a_r;
  wire [COLS*8-1:0] b_r;
  wire              av_r, f_r, rd_now;
  /* verilator lint_off UNUSEDSIGNAL */
  wire [      31:0] rd_row;  // no row select: the de-skewed bottom row is row rd_row
  /* verilator lint_on UNUSEDSIGNAL */
  sa_job_ctrl #(
      .A_W(ROWS * 8), .B_W(COLS * 8), .T_W(T_W), .STREAM_OFF(ROWS), .PRELOAD(ROWS),
      .READ_BASE(2 * ROWS + COLS), .FAULT(FAULT)
  ) u_ctrl (
      .clk(clk), .rst(rst), .start(start), .t_len(t_len), .a_vec(a_vec), .b_vec(b_vec),
      .busy(busy), .done(done), .out_valid(out_valid), .out_row(out_row),
      .a_r(a_r), .a_v(av_r), .b_r(b_r), .in_first(f_r), .rd_now(rd_now), .rd_row(rd_row)
  );

  // ---- weight load, skew, PE grid, de-skew ---------------------------------------
  // wsel[i]: b_r holds weight row i (registered at edge i), so PE row i writes it. The job's
  // first tag (edge 0) walks down a chain of one-edge delays, one per PE row.
  wire [ROWS-1:0] wsel;
  // Arrays of nets, one element per link (see systolic_os: Icarus is ~30x slower on one vector).
  // ah: A bundles {valid, a} entering PE(i,j) from the left (j = COLS: unused exit).
  // pv: partial sums entering PE(i,j) from the top (row 0 gets zeros).
  /* verilator lint_off UNUSEDSIGNAL */
  wire [ 8:0] ah[0:ROWS*(COLS+1)-1];
  /* verilator lint_on UNUSEDSIGNAL */
  wire [31:0] pv[0:(ROWS+1)*COLS-1];
  wire [31:0] aligned[0:COLS-1];

  genvar i, j;
  generate
    assign wsel[0] = f_r;
    for (i = 1; i < ROWS; i = i + 1) begin : g_wsel
      delay_line #(.WIDTH(1), .DEPTH(1)) u_d (.clk(clk), .rst(rst), .d(wsel[i-1]), .q(wsel[i]));
    end
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
            .w_load(wsel[i]),
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

  // ---- readout: one aligned output row per cycle --------------------------------
  integer c;
  always @(posedge clk) begin
    if (rst) out_data <= {COLS * 32{1'b0}};
    else if (rd_now) for (c = 0; c < COLS; c = c + 1) out_data[c*32+:32] <= aligned[c];
  end
endmodule

`default_nettype wire
