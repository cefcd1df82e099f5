// fp32_to_fp16: IEEE binary32 -> binary16 conversion, round to nearest, ties to even (combinational).
//
// Domain: x is zero or a normal binary32 number (the PIM front end's fp32 sums always are). Inside it
// y is bit-exact with IEEE (and numpy's float32 -> float16 cast): results below 2^-14 become fp16
// subnormals (a value under half of 2^-24 becomes a signed zero, exactly half of it rounds to the even
// zero), a rounding carry out of a subnormal gives the smallest normal, signed zeros keep their sign,
// and anything that rounds to 2^16 or more (|x| >= 65520) overflows to a signed infinity with
// ovf = 1. Outside the domain: a subnormal x reads as a signed zero; an infinity or NaN gives a signed
// infinity with ovf = 1.
//
// Method: the fp16 biased exponent of a normal x is E = exp32 - 112. E >= 1: keep the top 11 bits of
// the 24-bit significand (shift right 13). E <= 0: the fp16 subnormal count of 2^-24 units is the
// significand shifted right by 14 - E (clamped at 26, where only the sticky bit is left). Guard and
// sticky bits round half to even; the sum {E - 1 or 0, 10'b0} + significand + round carries naturally
// from the fraction into the exponent (subnormal -> normal, 65504 + ulp -> infinity).
//
// TRUNC (bench teeth only, pim_dequant_lane FAULT 2): 1 = truncate (round toward zero) instead.
`default_nettype none

module fp32_to_fp16 #(
    parameter integer TRUNC = 0
) (
    input  wire [31:0] x,
    output wire [15:0] y,
    output wire        ovf
);
  wire              sign = x[31];
  wire [      23:0] m = {1'b1, x[22:0]};
  wire signed [9:0] e16 = $signed({2'b00, x[30:23]}) - 10'sd112;
  wire              normal = e16 > 10'sd0;
  wire              big = e16 > 10'sd30;  // |x| >= 2^16 (and infinities / NaNs)
  // Right shift of m beyond the 13 every result takes: 0 for normals, (14 - E) - 13 = 1 - E clamped
  // to 13 for subnormals.
  wire signed [9:0] sub_extra = 10'sd1 - e16;  // >= 1 when !normal
  wire        [3:0] extra = normal ? 4'd0 : (sub_extra > 10'sd13) ? 4'd13 : sub_extra[3:0];
  wire       [36:0] w = {m, 13'd0} >> extra;  // no bit of m is lost: its lowest bit stays at >= 0
  wire       [10:0] units = w[36:26];  // the kept significand (with the hidden bit for normals)
  wire              guard = w[25];
  wire              sticky = |w[24:0];
  wire              up = (TRUNC == 0) && guard && (sticky || units[0]);
  wire        [4:0] ebase = normal ? e16[4:0] - 5'd1 : 5'd0;
  wire       [14:0] body = {ebase, 10'd0} + {4'd0, units} + {14'd0, up};
  wire              is_zero = (x[30:23] == 8'd0);
  assign ovf = !is_zero && (big || (body[14:10] == 5'd31));
  assign y = is_zero ? {sign, 15'd0} : ovf ? {sign, 5'h1F, 10'd0} : {sign, body};
endmodule

`default_nettype wire
