// tb_formats: calls kv_quant_engine's number-format functions on operands from hex files.
//
// A plain Verilog (Icarus) harness, not a cocotb bench: cocotb cannot call Verilog functions.
// Hierarchical calls u.f32_to_f16 / u.f16_to_f32 / u.to_code evaluate the engine's own functions
// (its BITS set by `BITS); test_rtl_kv_quant.py writes f32.hex, f16.hex, q.hex (N32, N16, NQ
// entries), runs this and compares out.hex with numpy's astype / rint + clip.
`timescale 1ns / 1ps
module tb_formats;
  kv_quant_engine #(
      .LANES(1),
      .HEAD_DIM(8),
      .BITS(`BITS)
  ) u (
      .clk(1'b0),
      .rst(1'b1),
      .start(1'b0),
      .n_vec(16'd0),
      .x_vec(16'd0),
      .lo(32'd0),
      .hi(32'd0)
  );
  reg [31:0] f32[0:`N32-1];
  reg [15:0] f16[0:`N16-1];
  reg [31:0] q[0:`NQ-1];
  integer i, fd;
  initial begin
    $readmemh("f32.hex", f32);
    $readmemh("f16.hex", f16);
    $readmemh("q.hex", q);
    fd = $fopen("out.hex", "w");
    for (i = 0; i < `N32; i = i + 1) $fdisplay(fd, "%h", u.f32_to_f16(f32[i]));
    for (i = 0; i < `N16; i = i + 1) $fdisplay(fd, "%h", u.f16_to_f32(f16[i]));
    for (i = 0; i < `NQ; i = i + 1) $fdisplay(fd, "%h", u.to_code(q[i]));
    $fclose(fd);
    $finish;
  end
endmodule
