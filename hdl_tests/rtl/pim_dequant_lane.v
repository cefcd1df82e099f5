// pim_dequant_lane: one lane of the PIM unit's dequantizing front end (`pim.dequant`): an integer code
// and its fp16 metadata become the fp16 operand the unit's MAC lanes take,
//
//     w = fp16_RNE( fp32_RNE( fp32(code) * scale ) + zero )        scale, zero: fp16 bit patterns
//
// bit-exact with codesign.accel_model.pim_dequant.dequant_operand (its docstring gives the rule and a
// case where one fused rounding would differ). The product is exact (u8_mul_fp16.v, an 8 x 11-bit
// integer multiply and a normalisation); zero becomes fp32 through the same multiplier with code 1
// (exact; synthesis folds the constant into a normaliser); the add is fp32_add.v (RNE); the last step
// fp32_to_fp16.v (RNE, fp16 subnormals, overflow to infinity).
//
// code is always 8 bits wide: a 2- or 4-bit code arrives unpacked in the low bits. BITS (2, 4 or 8)
// only decides which codes are legal.
//
// Interface contract (one element a cycle, no back-pressure):
//   * An element (code, scale, zero) with in_valid high is sampled at clock edge e.
//   * Pipeline: edge e input registers; e+1 exact product and zero as fp32; e+2 fp32 sum;
//     e+3 the fp16 operand on w, with out_valid and refuse. Latency 3 cycles (LANE_LATENCY in
//     accel_model/pim_dequant.py); n back-to-back elements take n + 3 cycles from the edge that samples
//     the first to the edge that registers the last, inclusive (`lane_cycles`).
//   * refuse = 1 marks an element the model refuses: code >= 2^BITS, a non-finite scale or zero
//     (exponent field 31), or an operand that overflows fp16 (w is then a signed infinity).
//     Inside the domain (refuse = 0) every w bit is the model's. w and refuse are meaningful only
//     with out_valid; data registers load only on valid elements.
//   * Why each fp32 sum is in fp32_add's domain: scale and zero are multiples of 2^-24 below 2^16,
//     so operands and exact sums are zero or multiples of 2^-24 below 2^25: zero or normal in fp32.
//
// FAULT (bench teeth only): 1 = a fused single rounding (code * scale + zero rounded once, to fp16):
// the fp32 add rounds to odd instead (Fast2Sum finds its exact error; an inexact sum with an even last
// bit steps one ulp toward the exact value), which makes the fp16 conversion round the exact sum once
// (24 >= 11 + 2 bits); 2 = the fp16 conversion truncates instead of rounding to nearest even.
`default_nettype none

module pim_dequant_lane #(
    parameter integer BITS  = 8,  // code width: 2, 4 or 8
    parameter integer FAULT = 0
) (
    input  wire        clk,
    input  wire        rst,
    input  wire        in_valid,
    input  wire [ 7:0] code,
    input  wire [15:0] scale,
    input  wire [15:0] zero,
    output reg         out_valid,
    output reg  [15:0] w,
    output reg         refuse
);
  localparam [8:0] CODE_LIMIT = 9'd1 << BITS;

  // ---- valid pipeline (the only registers that reset) --------------------------------------------
  reg v0, v1, v2;
  always @(posedge clk) begin
    if (rst) {v0, v1, v2, out_valid} <= 4'd0;
    else {v0, v1, v2, out_valid} <= {in_valid, v0, v1, v2};
  end

  // ---- edge e: input registers --------------------------------------------------------------------
  reg [7:0] c0;
  reg [15:0] s0, z0;
  always @(posedge clk) if (in_valid) {c0, s0, z0} <= {code, scale, zero};

  // ---- edge e+1: exact product, zero as fp32, the out-of-domain input flag --------------------------
  wire [31:0] prod, zero32;
  u8_mul_fp16 mul (.code(c0), .scale(s0), .y(prod));
  u8_mul_fp16 widen (.code(8'd1), .scale(z0), .y(zero32));
  wire bad_in = ({1'b0, c0} >= CODE_LIMIT) || (s0[14:10] == 5'h1F) || (z0[14:10] == 5'h1F);
  reg [31:0] p1, z1;
  reg bad1;
  always @(posedge clk) if (v0) {p1, z1, bad1} <= {prod, zero32, bad_in};

  // ---- edge e+2: fp32 sum (RNE) -----------------------------------------------------------------------
  wire [31:0] sum, sum_out;
  fp32_add add (.a(p1), .b(z1), .y(sum));
  generate
    if (FAULT == 1) begin : g_fused
      // Fast2Sum (|hi| >= |lo|): t = sum - hi and err = lo - t are exact, err = exact sum - sum.
      wire p_ge = p1[30:0] >= z1[30:0];
      wire [31:0] hi = p_ge ? p1 : z1;
      wire [31:0] lo = p_ge ? z1 : p1;
      wire [31:0] t, err;
      fp32_add f2s_t (.a(sum), .b({~hi[31], hi[30:0]}), .y(t));
      fp32_add f2s_e (.a(lo), .b({~t[31], t[30:0]}), .y(err));
      wire inexact = err[30:0] != 31'd0;
      wire away = err[31] == sum[31];  // the exact sum is farther from zero than sum
      assign sum_out = (inexact && !sum[0]) ? (away ? sum + 32'd1 : sum - 32'd1) : sum;
    end else begin : g_rne
      assign sum_out = sum;
    end
  endgenerate
  reg [31:0] s2;
  reg bad2;
  always @(posedge clk) if (v1) {s2, bad2} <= {sum_out, bad1};

  // ---- edge e+3: fp16 operand (RNE) ---------------------------------------------------------------------
  wire [15:0] half;
  wire ovf;
  fp32_to_fp16 #(.TRUNC(FAULT == 2 ? 1 : 0)) narrow (.x(s2), .y(half), .ovf(ovf));
  always @(posedge clk) if (v2) {w, refuse} <= {half, bad2 || ovf};
endmodule

`default_nettype wire
