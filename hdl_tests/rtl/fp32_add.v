// fp32_add: combinational IEEE-754 binary32 adder, y = a + b, round to nearest, ties to even.
//
// Domain (the KV-quant bench's model asserts it: Model._check_domain in hdl_tests/kv_quant/tb_kv_quant.py):
//   * a and b are finite and each is zero or normal (no NaN, no infinity, no subnormal operand);
//   * the exact result is zero or rounds to a normal number. In the KV quantization engine every
//     operand is an fp16 value or a difference of two, so results are never subnormal in fp32.
// Inside the domain y is bit-exact with IEEE (and numpy.float32): exact cancellation x + (-x) gives
// +0, (+0) + (-0) = +0, (-0) + (-0) = -0. Outside it the behaviour is defined but not IEEE: a result
// below the normal range flushes to a signed zero, one above it becomes infinity (the correctly
// rounded overflow), and subnormal operands are read as zero. Subtraction is a + {~b[31], b[30:0]}.
//
// Method: order the operands by magnitude (x >= z), align z's 24-bit significand to x's with three
// extra bits (guard, round, sticky; everything shifted past them ORs into the sticky bit), add or
// subtract, normalize (one right shift on a carry, a leading-zero shift left after cancellation:
// a shift of 2 or more only happens when the exponents differ by at most 1, so no sticky bit was
// lost), then round half to even on guard/round/sticky and renormalize a carry out of rounding.
`default_nettype none

module fp32_add (
    input  wire [31:0] a,
    input  wire [31:0] b,
    output wire [31:0] y
);
  // ---- order by magnitude: x has the larger |value| (x = a on ties) --------------------------
  wire        a_ge = a[30:0] >= b[30:0];
  wire [31:0] x = a_ge ? a : b;
  wire [31:0] z = a_ge ? b : a;
  wire [ 7:0] ex = x[30:23];
  wire [ 7:0] ez = z[30:23];
  // A zero (or, outside the domain, subnormal) operand has no hidden bit and reads as zero.
  wire [23:0] mx = (ex == 8'd0) ? 24'd0 : {1'b1, x[22:0]};
  wire [23:0] mz = (ez == 8'd0) ? 24'd0 : {1'b1, z[22:0]};
  wire        sub = x[31] ^ z[31];

  // ---- align: z's significand shifted right by ex - ez into 27 bits + sticky ---------------------
  wire [ 7:0] d = ex - ez;  // ex >= ez because |x| >= |z|
  // Shifting by 27 or more leaves only the sticky bit, so clamp the distance there.
  wire [ 5:0] dc = (d > 8'd27) ? 6'd27 : d[5:0];
  wire [53:0] zw = {mz, 3'b000, 27'd0} >> dc;
  wire [26:0] za = {zw[53:28], zw[27] | (|zw[26:0])};  // sticky folded into bit 0
  wire [26:0] xa = {mx, 3'b000};

  // ---- add / subtract --------------------------------------------------------------------------
  wire [27:0] s = sub ? {1'b0, xa} - {1'b0, za} : {1'b0, xa} + {1'b0, za};

  // ---- normalize ----------------------------------------------------------------------------
  reg  [ 4:0] lz;  // leading zeros of s[26:0]
  integer     i;
  always @(*) begin
    lz = 5'd27;
    for (i = 0; i < 27; i = i + 1) if (s[i]) lz = 5'd26 - i[4:0];
  end
  wire        carry = s[27];
  // n has its leading one at bit 26: the 24-bit significand, then guard, round, sticky.
  wire [26:0] n = carry ? {s[27:2], s[1] | s[0]} : (s[26:0] << lz);
  wire signed [9:0] en = carry ? $signed({2'b00, ex}) + 10'sd1 : $signed({2'b00, ex}) - $signed({5'd0, lz});

  // ---- round to nearest, ties to even -----------------------------------------------------------
  wire        rnd_up = n[2] & (n[1] | n[0] | n[3]);
  wire [24:0] mr = {1'b0, n[26:3]} + {24'd0, rnd_up};
  wire [22:0] frac = mr[24] ? mr[23:1] : mr[22:0];  // a carry out of rounding leaves 1.000...
  wire signed [9:0] er = mr[24] ? en + 10'sd1 : en;

  // ---- specials at the result: zero, below range (flush), overflow (infinity) -----------------
  wire        is_zero = (s == 28'd0);
  // An exact zero sum is +0 unless both operands are -0 (IEEE 754 6.3, round to nearest).
  wire        zero_sign = a[31] & b[31];
  wire        under = (er < 10'sd1);
  wire        over = (er > 10'sd254);
  assign y = is_zero ? {zero_sign, 31'd0}
           : under   ? {x[31], 31'd0}
           : over    ? {x[31], 8'hFF, 23'd0}
           : {x[31], er[7:0], frac};
endmodule

`default_nettype wire
