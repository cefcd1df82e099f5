// u8_mul_fp16: exact product of an unsigned 8-bit integer code and an IEEE binary16 scale, as an IEEE
// binary32 number (combinational). The PIM dequantizing front end's "multiply" (pim_dequant_lane.v).
//
// Domain: finite scale (exponent field != 31); normal, subnormal or zero. The product is then exact
// in binary32: an 8-bit code times an 11-bit significand has at most 19 significant bits (binary32
// keeps 24), and a nonzero |code * scale| lies in [2^-24, 255 * 65504], inside binary32's normal range.
//
//   significand s = {exp != 0, frac} (11 bits), exponent e = max(exp, 1); scale = s * 2^(e - 25)
//   P = code * s (19 bits), value = P * 2^(e - 25)
//   P != 0 with its leading one at bit h: value = 1.f * 2^(h + e - 25), so the binary32 exponent
//   field is h + e + 102 (in [103, 150]) and f is P below bit h, left-aligned.
//   P == 0 (code 0 or a zero scale): a zero with the scale's sign, as IEEE gives for +code * scale
//   (numpy: float32(0) * -0.5 = -0.0).
`default_nettype none

module u8_mul_fp16 (
    input  wire [ 7:0] code,
    input  wire [15:0] scale,
    output wire [31:0] y
);
  wire [10:0] sig = {scale[14:10] != 5'd0, scale[9:0]};
  wire [ 4:0] e = (scale[14:10] == 5'd0) ? 5'd1 : scale[14:10];
  wire [18:0] p = {11'd0, code} * {8'd0, sig};

  // Leading one of p (h = 0 when p == 0; that case is handled below).
  reg [4:0] h;
  integer i;
  always @(*) begin
    h = 5'd0;
    for (i = 0; i < 19; i = i + 1) if (p[i]) h = i[4:0];
  end

  // Shift the leading one to bit 23 (just above this 23-bit fraction, so it drops out). The shift
  // is >= 5, so no bit of p is lost.
  wire [22:0] frac = {4'd0, p} << (5'd23 - h);
  wire [ 7:0] exp32 = {3'd0, h} + {3'd0, e} + 8'd102;
  assign y = (p == 19'd0) ? {scale[15], 31'd0} : {scale[15], exp32, frac};
endmodule

`default_nettype wire
