// sa_pe_os: one processing element of the output-stationary int8 systolic array.
// The A operand (with its valid and first-of-job tags) moves right, the B operand
// moves down, and the int32 partial sum stays here. A MAC happens on the clock edge
// at which a valid operand pair is at the inputs; the first pair of a job
// overwrites the accumulator, so back-to-back jobs need no clear cycle.
//
// FAULT = 2 injects a one-line "wrong accumulate" fault (the first pair no longer
// clears the accumulator); it exists only so the bench can prove it catches it.
`default_nettype none

module sa_pe_os #(
    parameter integer FAULT = 0
) (
    input  wire        clk,
    input  wire        rst,
    input  wire [ 9:0] a_in,    // {first, valid, int8 a}
    input  wire [ 7:0] b_in,    // int8 b
    output reg  [ 9:0] a_out,
    output reg  [ 7:0] b_out,
    output reg  [31:0] acc
);
  wire               a_valid = a_in[8];
  wire               a_first = a_in[9];
  wire signed [15:0] prod = $signed(a_in[7:0]) * $signed(b_in);
  wire        [31:0] prod32 = {{16{prod[15]}}, prod};

  always @(posedge clk) begin
    if (rst) begin
      a_out <= 10'd0;
      b_out <= 8'd0;
      acc   <= 32'd0;
    end else begin
      a_out <= a_in;
      b_out <= b_in;
      if (a_valid) acc <= (a_first && FAULT != 2) ? prod32 : acc + prod32;
    end
  end
endmodule

`default_nettype wire
