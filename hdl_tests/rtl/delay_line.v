// delay_line: WIDTH-bit shift register of DEPTH stages (DEPTH = 0 is a wire).
// Used for the operand skew into a systolic array (row i delayed i cycles) and
// for de-skewing its outputs. Synchronous active-high reset clears every stage,
// so valid/tag bits that ride in the line never come out as X.
`default_nettype none

module delay_line #(
    parameter integer WIDTH = 8,
    parameter integer DEPTH = 1
) (
    // clk/rst are unused when DEPTH = 0 (the line is a wire).
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire             clk,
    input  wire             rst,
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire [WIDTH-1:0] d,
    output wire [WIDTH-1:0] q
);
  generate
    if (DEPTH == 0) begin : g_wire
      assign q = d;
    end else begin : g_regs
      reg [WIDTH-1:0] stage[0:DEPTH-1];
      integer s;
      always @(posedge clk) begin
        if (rst) begin
          for (s = 0; s < DEPTH; s = s + 1) stage[s] <= {WIDTH{1'b0}};
        end else begin
          stage[0] <= d;
          for (s = 1; s < DEPTH; s = s + 1) stage[s] <= stage[s-1];
        end
      end
      assign q = stage[DEPTH-1];
    end
  endgenerate
endmodule

`default_nettype wire
