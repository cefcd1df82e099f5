// sa_job_ctrl: the job control and input stage shared by systolic_os and systolic_ws.
//
// It owns everything about a job except the array: accepting `start`, the edge
// counter, latching t, the operand windows (with the input register that zeroes
// operands outside them), the readout window and busy/done/out_valid/out_row.
// The top owns the PE grid, operand routing and out_data (loaded when rd_now is
// high, from output row rd_row); each top's header derives its timing.
//
// Edges are counted from the one that accepts `start` (edge 0: start high, busy
// low, t_len != 0). With t the latched t_len:
//   * a_vec is sampled in the stream window, edges STREAM_OFF .. STREAM_OFF+t-1;
//     b_vec in the preload window, edges 0 .. PRELOAD-1, if PRELOAD > 0, else in
//     the stream window too. Edge e registers the samples onto a_r/b_r, with a_v
//     (a_r is in its window) and in_first (e = 0); outside its window an operand
//     registers as 0, so X on an idle bus never reaches the array.
//   * Output row r (r = 0 .. N-1; N = N_OUT, or t if N_OUT = 0) is read at edge
//     READ_BASE + r, plus t if READ_PLUS_T: rd_now is high with rd_row = r in the
//     cycle before, and the edge registers out_valid, out_row = r (and the top's
//     out_data). Row N-1 also raises `done` for one cycle and drops busy, so
//     `start` may be accepted on the next edge.
//
// FAULT = 1 (bench teeth only) reads every row one edge early.
`default_nettype none

module sa_job_ctrl #(
    parameter integer A_W         = 8,
    parameter integer B_W         = 8,
    parameter integer T_W         = 16,
    parameter integer STREAM_OFF  = 0,
    parameter integer PRELOAD     = 0,
    parameter integer READ_BASE   = 1,
    parameter integer READ_PLUS_T = 0,
    parameter integer N_OUT       = 0,
    parameter integer FAULT       = 0
) (
    input  wire           clk,
    input  wire           rst,
    input  wire           start,
    input  wire [T_W-1:0] t_len,
    input  wire [A_W-1:0] a_vec,
    input  wire [B_W-1:0] b_vec,
    output reg            busy,
    output reg            done,
    output reg            out_valid,
    output reg  [   15:0] out_row,
    output reg  [A_W-1:0] a_r,
    output reg            a_v,
    output reg  [B_W-1:0] b_r,
    output reg            in_first,
    output wire           rd_now,
    output wire [   31:0] rd_row
);
  localparam [31:0] S_OFF = STREAM_OFF;
  localparam [31:0] N_PRE = PRELOAD;
  localparam [31:0] LAST_FIXED = N_OUT - 1;  // unused when N_OUT = 0 (t rows)

  wire        accept = start && !busy && (t_len != {T_W{1'b0}});
  reg  [31:0] ecnt;  // while busy: index of the coming edge, counted from the accepting edge 0
  reg  [31:0] t_lat;  // t of the running job
  wire [31:0] t_now = accept ? {{(32 - T_W) {1'b0}}, t_len} : t_lat;
  wire [31:0] e_now = accept ? 32'd0 : ecnt;
  wire        live = accept || busy;
  // A zero STREAM_OFF or PRELOAD makes a compare below constant: fine, it folds away.
  /* verilator lint_off UNSIGNED */
  wire        s_win = live && (e_now >= S_OFF) && (e_now - S_OFF < t_now);
  wire        p_win = live && (e_now < N_PRE);
  /* verilator lint_on UNSIGNED */
  wire        b_win = (PRELOAD > 0) ? p_win : s_win;
  wire [31:0] rd_base = READ_BASE + ((READ_PLUS_T != 0) ? t_lat : 32'd0) - ((FAULT == 1) ? 32'd1 : 32'd0);
  wire [31:0] last_row = (N_OUT == 0) ? t_lat - 32'd1 : LAST_FIXED;
  assign rd_now = busy && (ecnt >= rd_base);
  assign rd_row = ecnt - rd_base;

  always @(posedge clk) begin
    if (rst) begin
      a_r       <= {A_W{1'b0}};
      a_v       <= 1'b0;
      b_r       <= {B_W{1'b0}};
      in_first  <= 1'b0;
      busy      <= 1'b0;
      done      <= 1'b0;
      out_valid <= 1'b0;
      out_row   <= 16'd0;
      ecnt      <= 32'd0;
      t_lat     <= 32'd0;
    end else begin
      a_r       <= s_win ? a_vec : {A_W{1'b0}};
      a_v       <= s_win;
      b_r       <= b_win ? b_vec : {B_W{1'b0}};
      in_first  <= accept;
      done      <= 1'b0;
      out_valid <= 1'b0;
      if (accept) begin
        busy  <= 1'b1;
        ecnt  <= 32'd1;
        t_lat <= t_now;
      end else if (busy) begin
        ecnt <= ecnt + 32'd1;
        if (rd_now) begin
          out_valid <= 1'b1;
          out_row   <= rd_row[15:0];
          if (rd_row == last_row) begin
            done <= 1'b1;
            busy <= 1'b0;
          end
        end
      end
    end
  end
endmodule

`default_nettype wire
