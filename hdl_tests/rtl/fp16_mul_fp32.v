// fp16_mul_fp32: exact product of two IEEE binary16 numbers as an IEEE binary32 number (combinational).
//
// Domain: finite operands (exponent field != 31); normals, subnormals and zeros. The product is
// then always exact in binary32: significands of at most 11 bits give a product of at most 22
// bits (binary32 keeps 24), and |a*b| lies in [2^-48, 65504^2] or is zero, inside binary32's
// normal range, so no rounding and no subnormal result can occur.
//
//   significand s = {exp != 0, frac} (11 bits), exponent e = max(exp, 1); value = s * 2^(e - 25)
//   P = sa * sb (22 bits), value = P * 2^(ea + eb - 50)
//   P != 0 with its leading one at bit h: value = 1.f * 2^(h + ea + eb - 50), so the binary32
//   exponent field is h + ea + eb + 77 (in [79, 158]) and f is P below bit h, left-aligned.
//   P == 0: a zero with sign sign(a) xor sign(b), as IEEE multiplication gives.
`default_nettype none

module fp16_mul_fp32 (
    input  wire [15:0] a,
    input  wire [15:0] b,
    output wire [31:0] y
);
  wire        sign = a[15] ^ b[15];
  wire [10:0] sa = {a[14:10] != 5'd0, a[9:0]};
  wire [10:0] sb = {b[14:10] != 5'd0, b[9:0]};
  wire [ 4:0] ea = (a[14:10] == 5'd0) ? 5'd1 : a[14:10];
  wire [ 4:0] eb = (b[14:10] == 5'd0) ? 5'd1 : b[14:10];
  wire [21:0] p = sa * sb;

  // Leading one of p (h = 0 when p == 0; that case is handled below).
  reg [4:0] h;
  integer i;
  always @(*) begin
    h = 5'd0;
    for (i = 0; i < 22; i = i + 1) if (p[i]) h = i[4:0];
  end

  // Shift the leading one to bit 23 (just above this 23-bit result, so it drops out): the binary32
  // fraction. The shift is >= 2, so no bit of p is lost.
  wire [22:0] frac = {1'b0, p} << (5'd23 - h);
  wire [ 7:0] exp32 = {3'd0, h} + {3'd0, ea} + {3'd0, eb} + 8'd77;
  assign y = (p == 22'd0) ? {sign, 31'd0} : {sign, exp32, frac};
endmodule

`default_nettype wire
