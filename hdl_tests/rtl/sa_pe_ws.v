// sa_pe_ws: one processing element of the weight-stationary int8 systolic array.
// The weight stays here (loaded when w_load is high), the A operand (with its valid
// tag) moves right, and the int32 partial sum moves down: p_out = p_in + a * w on
// every edge with a valid operand.
//
// FAULT = 2 injects a one-line "wrong accumulate" fault (adds to this PE's own old
// sum instead of the partial sum from above); it exists only for the bench's teeth.
`default_nettype none

module sa_pe_ws #(
    parameter integer FAULT = 0
) (
    input  wire        clk,
    input  wire        rst,
    input  wire [ 8:0] a_in,    // {valid, int8 a}
    input  wire [ 7:0] w_in,    // int8 weight
    input  wire        w_load,
    input  wire [31:0] p_in,    // partial sum from the PE above (0 for row 0)
    output reg  [ 8:0] a_out,
    output reg  [31:0] p_out
);
  reg         [ 7:0] w;
  wire signed [15:0] prod = $signed(a_in[7:0]) * $signed(w);
  wire        [31:0] prod32 = {{16{prod[15]}}, prod};

  always @(posedge clk) begin
    if (rst) begin
      w     <= 8'd0;
      a_out <= 9'd0;
      p_out <= 32'd0;
    end else begin
      if (w_load) w <= w_in;
      a_out <= a_in;
      if (a_in[8]) p_out <= ((FAULT == 2) ? p_out : p_in) + prod32;
    end
  end
endmodule

`default_nettype wire
