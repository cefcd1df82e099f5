// fp32_div: pipelined IEEE-754 binary32 divider, y = a / b, round to nearest, ties to even.
//
// Throughput one division per cycle; fixed latency LATENCY = ceil(27 / STEP) + 2 edges: operands
// on a/b before edge k give y after edge k + LATENCY - 1 (edge k registers the unpacked operands,
// each of the ceil(27 / STEP) stages retires STEP quotient bits, the last edge rounds into y).
// accel_model/kv_quant_control.py (div_latency) states the same formula; the bench checks it.
//
// Domain: a and b finite, each zero or normal, b != 0, and the exact quotient zero or inside the
// normal range. In the KV quantization engine every dividend is an fp16 value or a difference of
// two and every divisor is 2^b - 1 or a nonzero fp16 scale, so quotients are always normal.
// Inside the domain y is bit-exact with numpy.float32 division. Outside it: 0 / 0 gives the quiet
// NaN 0x7FC00000, x / 0 a signed infinity, quotients above the range infinity, below it a signed
// zero (flush), subnormal operands read as zero; infinities and NaNs as operands are not handled.
//
// Method: restoring division of the 24-bit significands. The partial remainder starts at ma
// (< 2 mb) and each step emits one quotient bit, so after QB = STEP x stages steps
// Q = floor(ma 2^(QB-1) / mb), in [2^(QB-2), 2^QB); QB >= 27 leaves a 24-bit significand, a guard
// bit and at least one more bit that, ORed with (remainder != 0), is the sticky bit.
`default_nettype none

module fp32_div #(
    parameter integer STEP = 4  // quotient bits per pipeline stage, 1..27
) (
    input  wire        clk,
    input  wire [31:0] a,
    input  wire [31:0] b,
    output reg  [31:0] y
);
  localparam integer NS = (27 + STEP - 1) / STEP;  // divider stages
  localparam integer QB = NS * STEP;  // quotient bits computed (>= 27)
  // Latency: NS + 2 edges (module header).
  localparam integer W = 1 + 10 + 2 + 24;  // per-stage side band: sign, exponent, kind, divisor

  // Result kinds carried down the pipe.
  localparam [1:0] K_NUM = 2'd0, K_ZERO = 2'd1, K_INF = 2'd2, K_NAN = 2'd3;

  // ---- edge 0: unpack ---------------------------------------------------------------------------
  wire        a_zero = (a[30:23] == 8'd0);
  wire        b_zero = (b[30:23] == 8'd0);
  wire [ 1:0] kind_in = (a_zero && b_zero) ? K_NAN : b_zero ? K_INF : a_zero ? K_ZERO : K_NUM;
  wire signed [9:0] exp_in = $signed({2'b00, a[30:23]}) - $signed({2'b00, b[30:23]}) + 10'sd127;

  // Stage buses: slice s holds what stage s registered (s = 0: the unpacked operands).
  wire [(NS+1)*25-1:0] rem_bus;
  wire [(NS+1)*QB-1:0] q_bus;
  wire [ (NS+1)*W-1:0] side_bus;

  reg  [         24:0] rem0;
  reg  [        W-1:0] side0;
  always @(posedge clk) begin
    rem0  <= {1'b0, ~a_zero, a[22:0]};
    side0 <= {a[31] ^ b[31], exp_in, kind_in, ~b_zero, b[22:0]};
  end
  assign rem_bus[0+:25] = rem0;
  assign q_bus[0+:QB]   = {QB{1'b0}};
  assign side_bus[0+:W] = side0;

  // ---- edges 1 .. NS: STEP restoring steps each ---------------------------------------------------
  genvar s;
  generate
    for (s = 0; s < NS; s = s + 1) begin : g_stage
      wire [  24:0] rem_in = rem_bus[s*25+:25];
      wire [QB-1:0] q_in = q_bus[s*QB+:QB];
      wire [   W-1:0] side_in = side_bus[s*W+:W];
      wire [  24:0] dv = {1'b0, side_in[23:0]};
      reg  [  24:0] r;
      reg  [QB-1:0] q;
      integer       k;
      always @(*) begin
        r = rem_in;
        q = q_in;
        for (k = 0; k < STEP; k = k + 1) begin
          // r < 2 dv always holds, so one compare decides the bit and r - dv < dv fits after the shift.
          if (r >= dv) begin
            q = {q[QB-2:0], 1'b1};
            r = r - dv;
          end else begin
            q = {q[QB-2:0], 1'b0};
          end
          r = {r[23:0], 1'b0};
        end
      end
      reg [  24:0] rem_r;
      reg [QB-1:0] q_r;
      reg [   W-1:0] side_r;
      always @(posedge clk) begin
        rem_r  <= r;
        q_r    <= q;
        side_r <= side_in;
      end
      assign rem_bus[(s+1)*25+:25] = rem_r;
      assign q_bus[(s+1)*QB+:QB]   = q_r;
      assign side_bus[(s+1)*W+:W]  = side_r;
    end
  endgenerate

  // ---- edge NS+1: normalize, round half to even, pack ----------------------------------------------
  wire [  24:0] rem_f = rem_bus[NS*25+:25];
  wire [QB-1:0] q_f = q_bus[NS*QB+:QB];
  wire [   W-1:0] side_f = side_bus[NS*W+:W];
  wire          sign_f = side_f[W-1];
  wire signed [9:0] exp_f = side_f[W-2-:10];
  wire [   1:0] kind_f = side_f[25:24];
  wire          top = q_f[QB-1];  // quotient >= 1
  wire [QB-1:0] nq = top ? q_f : {q_f[QB-2:0], 1'b0};  // leading one at bit QB-1
  wire [  23:0] m24 = nq[QB-1-:24];
  wire          guard = nq[QB-25];
  wire          sticky = (|nq[QB-26:0]) | (|rem_f);
  wire          up = guard & (sticky | m24[0]);
  wire [  24:0] mr = {1'b0, m24} + {24'd0, up};
  wire signed [9:0] e1 = top ? exp_f : exp_f - 10'sd1;
  wire signed [9:0] er = mr[24] ? e1 + 10'sd1 : e1;
  wire [  22:0] frac = mr[24] ? mr[23:1] : mr[22:0];
  always @(posedge clk) begin
    case (kind_f)
      K_ZERO:  y <= {sign_f, 31'd0};
      K_INF:   y <= {sign_f, 8'hFF, 23'd0};
      K_NAN:   y <= 32'h7FC00000;
      default: y <= (er < 10'sd1) ? {sign_f, 31'd0} : (er > 10'sd254) ? {sign_f, 8'hFF, 23'd0} : {sign_f, er[7:0], frac};
    endcase
  end
endmodule

`default_nettype wire
