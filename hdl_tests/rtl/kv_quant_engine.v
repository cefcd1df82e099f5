// kv_quant_engine: the KV quantization engine of accel_model/kv_quant_engine.py, bit- and cycle-exact.
//
// Per K or V vector of HEAD_DIM fp16 elements (one token, one kv head), LANES elements a beat:
//   pass 1: min/max of the vector (OAKEN = 1: of its inner elements, those with lo <= x <= hi in
//           fp32; none inner gives min = max = 0), and for OAKEN the outlier list (position, fp16
//           value) in position order;
//   scale:  scale = fp16_rne(fp32(mx - mn) / fp32(2^BITS - 1)) (fp16 subnormals and zero exactly as
//           numpy's astype), zero = mn (already an fp16 value);
//   pass 2: code = clamp(rint(fp32(fp32(x - zero) / scale)), 0, 2^BITS - 1), rint = round half to
//           even on the rounded fp32 quotient (as np.rint does); scale == 0 or an outlier gives 0;
//           packed LANES x BITS bits a beat, element i of the beat at bits [i*BITS +: BITS], so the
//           beats of a vector concatenated LSB first are kv_quant_engine.pack_codes' bytes.
// fp32 arithmetic is rtl/fp32_add.v (subtraction flips b's sign) and rtl/fp32_div.v; every operand
// is an fp16 value or a difference of two, inside both modules' zero-or-normal domain.
// Inputs: fp16 (the KV cache dtype), never NaN or infinity (the model rejects those), and -0 is
// compared as +0 (numpy's min/max may return either zero, so the bench sends no -0).
// Thresholds lo/hi are fp32 bit patterns, sampled with `start`; x < lo or x > hi is an outlier.
//
// Interface contract (no back-pressure), edges counted from the one accepting `start` (edge 0):
//   * `start` is accepted when busy is low and n_vec != 0. B = HEAD_DIM / LANES beats a vector,
//     OC = ceil(MAX_OUT / OUT_PORTS) outlier cycles (OAKEN), PV = max(B, OC) cycles a vector slot.
//     Beat j of vector v (elements j*LANES .. j*LANES + LANES - 1, element i at x_vec[16*i +: 16])
//     must be on x_vec at edge v*PV + j; inputs at other edges are ignored.
//   * Codes: beat j of vector v leaves on q_codes (q_valid; q_last on j = B-1; q_scale, q_zero
//     fp16 bits) after edge (v+1)*PV + j + 2*DL + 3, DL = ceil(27/DIV_STEP) + 2 the divider latency.
//     The last beat of the last vector also raises `done` (and drops busy), so start -> done =
//     n_vec * PV + B + 2*DL + 4 cycles = kvq_cost's ceil(vectors/count) x per_vector + beats + depth
//     with depth = accel_model/kv_quant_control.rtl_depth(DIV_STEP).
//   * Outliers (OAKEN): vector v's window is OC cycles from the edge v*PV + B; ol_first marks its
//     first cycle (one window per vector, even without outliers), OUT_PORTS entries a cycle with
//     ol_valid[p], ol_pos[16p +: 16] (element index), ol_val[16p +: 16] (the fp16 input bits).
//     More than MAX_OUT outliers: the first MAX_OUT (by position) are sent and ol_ovf is raised
//     with ol_first; their codes are 0 and they stay out of the min/max as always.
//
// FAULT (bench teeth only): 1 = codes round half up instead of half to even; 2 = the vector slot
// counter wraps one cycle late (an off-by-one in the beat counter).
`default_nettype none

module kv_quant_engine #(
    parameter integer LANES     = 4,
    parameter integer HEAD_DIM  = 16,
    parameter integer BITS      = 4,   // 2, 4 or 8
    parameter integer OAKEN     = 0,
    parameter integer MAX_OUT   = 2,   // outlier slots per vector (OAKEN)
    parameter integer OUT_PORTS = 1,   // outliers emitted per cycle (OAKEN)
    parameter integer DIV_STEP  = 4,   // quotient bits per divider stage
    parameter integer FAULT     = 0
) (
    input  wire                    clk,
    input  wire                    rst,
    input  wire                    start,
    input  wire [            15:0] n_vec,
    input  wire [    LANES*16-1:0] x_vec,
    // Thresholds are unused without OAKEN.
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [            31:0] lo,
    input  wire [            31:0] hi,
    /* verilator lint_on UNUSEDSIGNAL */
    output reg                     busy,
    output reg                     done,
    output reg                     q_valid,
    output reg                     q_last,
    output reg  [  LANES*BITS-1:0] q_codes,
    output reg  [            15:0] q_scale,
    output reg  [            15:0] q_zero,
    output reg                     ol_first,
    output reg                     ol_ovf,
    output reg  [   OUT_PORTS-1:0] ol_valid,
    output reg  [OUT_PORTS*16-1:0] ol_pos,
    output reg  [OUT_PORTS*16-1:0] ol_val
);
  localparam integer B = HEAD_DIM / LANES;
  localparam integer OC = (OAKEN != 0) ? (MAX_OUT + OUT_PORTS - 1) / OUT_PORTS : 0;
  localparam integer PV = (OC > B) ? OC : B;
  localparam integer PV_RUN = PV + ((FAULT == 2) ? 1 : 0);  // the slot the counter actually runs
  localparam integer DL = (27 + DIV_STEP - 1) / DIV_STEP + 2;  // fp32_div latency
  localparam integer QMAX = (1 << BITS) - 1;
  localparam [31:0] QMAX_F32 = (BITS == 2) ? 32'h40400000 : (BITS == 4) ? 32'h41700000 : 32'h437F0000;
  localparam integer MO = (OAKEN != 0) ? MAX_OUT : 1;  // outlier slots built
  localparam integer EP = (OAKEN != 0) ? OC * OUT_PORTS : 1;  // slots in the emission register (>= MO)
  localparam integer TAGW = 3 + LANES;  // valid, last, job-last, outlier mask per lane
  localparam integer HALF_UP = (FAULT == 1) ? 1 : 0;
  localparam [24:0] QMAX25 = QMAX[24:0];

  // ---- number-format helpers (pure functions) -------------------------------------------------
  // fp16 -> fp32, exact (fp16 subnormals become fp32 normals).
  function [31:0] f16_to_f32(input [15:0] h);
    reg [4:0] p;
    reg [9:0] frac;
    integer k;
    begin
      p = 5'd0;
      for (k = 0; k < 10; k = k + 1) if (h[k]) p = k[4:0];  // leading one of a subnormal
      frac = h[9:0] << (5'd10 - p);  // the bits below it, top-aligned
      if (h[14:0] == 15'd0) f16_to_f32 = {h[15], 31'd0};
      else if (h[14:10] == 5'd0) f16_to_f32 = {h[15], 8'd103 + {3'd0, p}, frac, 13'd0};
      else f16_to_f32 = {h[15], {3'd0, h[14:10]} + 8'd112, h[9:0], 13'd0};
    end
  endfunction

  // Order-preserving unsigned keys (both zeros map to the same key).
  function [15:0] key16(input [15:0] h);
    key16 = (h[14:0] == 15'd0) ? 16'h8000 : h[15] ? ~h : {1'b1, h[14:0]};
  endfunction
  function [15:0] unkey16(input [15:0] k);
    unkey16 = k[15] ? {1'b0, k[14:0]} : ~k;
  endfunction
  function [31:0] key32(input [31:0] f);
    key32 = (f[30:0] == 31'd0) ? 32'h80000000 : f[31] ? ~f : {1'b1, f[30:0]};
  endfunction

  // sig / 2^sh rounded to nearest, ties to even (ties up when half_up), for sh in 1..24.
  function [24:0] round_shift(input [23:0] sig, input [4:0] sh, input half_up);
    reg [23:0] ip, below;
    reg        up;
    begin
      ip          = sig >> sh;
      below       = sig << (5'd24 - sh);  // the bits shifted out, top-aligned
      up          = below[23] & (half_up | (|below[22:0]) | ip[0]);
      round_shift = {1'b0, ip} + {24'd0, up};
    end
  endfunction

  // fp32 (zero or normal, >= 0, below 65520) -> fp16, round half to even, subnormals as numpy.
  function [15:0] f32_to_f16(input [31:0] f);
    reg [ 7:0] e;
    /* verilator lint_off UNUSEDSIGNAL */
    reg [24:0] r;  // at most 2048
    /* verilator lint_on UNUSEDSIGNAL */
    begin
      e = f[30:23];
      if (e == 8'd0) begin
        f32_to_f16 = {f[31], 15'd0};
      end else if (e >= 8'd113) begin  // fp16 normal: 11-bit significand, a carry bumps the exponent
        r = round_shift({1'b1, f[22:0]}, 5'd13, 1'b0);
        f32_to_f16 = {f[31], {e[4:0] - 5'd17, 10'd0} + r[14:0]};  // (e - 113) << 10 + r, mod 2^15
      end else if (e >= 8'd102) begin  // fp16 subnormal: units of 2^-24, shift 126 - e in 14..24
        r = round_shift({1'b1, f[22:0]}, 5'd30 - e[4:0], 1'b0);
        f32_to_f16 = {f[31], r[14:0]};
      end else begin
        f32_to_f16 = {f[31], 15'd0};  // below a quarter of the smallest subnormal
      end
    end
  endfunction

  // fp32 quotient -> code: rint, then clamp to [0, QMAX] (negative values give 0).
  function [7:0] to_code(input [31:0] f);
    reg [ 7:0] e;
    reg [24:0] r;
    begin
      e = f[30:23];
      r = round_shift({1'b1, f[22:0]}, 5'd22 - e[4:0], HALF_UP[0]);  // 150 - e, used for e in 126..135
      if (f[31] || e < 8'd126) to_code = 8'd0;
      else if (e >= 8'd136 || r > QMAX25) to_code = QMAX[7:0];
      else to_code = r[7:0];
    end
  endfunction

  // ---- input control: slot and vector counters ------------------------------------------------
  wire        accept = start && !busy && (n_vec != 16'd0);
  reg  [31:0] sc;  // cycle inside the current vector slot
  reg  [15:0] vc;  // vectors whose slot has ended
  reg  [15:0] nv;
  reg  [31:0] lo_r, hi_r;
  wire [31:0] sc_now = accept ? 32'd0 : sc;
  wire [15:0] vc_now = accept ? 16'd0 : vc;
  wire [15:0] nv_now = accept ? n_vec : nv;
  wire        active = accept || (busy && vc < nv);
  wire        feed = active && (sc_now < B);
  wire        slot_end = (sc_now == PV_RUN - 1);

  // ---- stage X: input register ------------------------------------------------------------
  reg [LANES*16-1:0] x_r;
  reg x_v, x_first, x_last, x_jlast;
  /* verilator lint_off UNUSEDSIGNAL */
  reg [15:0] x_beat;  // outlier positions (OAKEN only)
  /* verilator lint_on UNUSEDSIGNAL */
  always @(posedge clk) begin
    if (rst) begin
      x_r <= {LANES * 16{1'b0}};
      {x_v, x_first, x_last, x_jlast} <= 4'd0;
      x_beat <= 16'd0;
    end else begin
      x_r     <= feed ? x_vec : {LANES * 16{1'b0}};
      x_v     <= feed;
      x_first <= feed && (sc_now == 32'd0);
      x_last  <= feed && (sc_now == B - 1);
      x_jlast <= feed && (sc_now == B - 1) && (vc_now == nv_now - 16'd1);
      x_beat  <= sc_now[15:0];
    end
  end

  // ---- pass 1: threshold compare, inner min/max, outlier list ---------------------------------
  reg  [LANES-1:0] mask;  // outliers of the beat in x_r
  reg  [     15:0] bmin, bmax;  // keys of the beat's inner min / max
  reg              bany;
  integer          i;
  always @(*) begin
    bany = 1'b0;
    bmin = 16'hFFFF;
    bmax = 16'h0000;
    for (i = 0; i < LANES; i = i + 1) begin
      mask[i] = (OAKEN != 0) && ((key32(f16_to_f32(x_r[16*i+:16])) < key32(lo_r))
                              || (key32(f16_to_f32(x_r[16*i+:16])) > key32(hi_r)));
      if (!mask[i]) begin
        bany = 1'b1;
        if (key16(x_r[16*i+:16]) < bmin) bmin = key16(x_r[16*i+:16]);
        if (key16(x_r[16*i+:16]) > bmax) bmax = key16(x_r[16*i+:16]);
      end
    end
  end
  reg  [15:0] run_min, run_max;
  reg         run_any;
  wire [15:0] new_min = (x_first || bmin < run_min) ? bmin : run_min;
  wire [15:0] new_max = (x_first || bmax > run_max) ? bmax : run_max;
  wire        new_any = x_first ? bany : (run_any | bany);
  reg  [15:0] mn16, mx16;  // the closed vector's min / max (fp16 bits)
  reg         stat_v;
  always @(posedge clk) begin
    if (rst) begin
      run_min <= 16'd0;
      run_max <= 16'd0;
      run_any <= 1'b0;
      mn16    <= 16'd0;
      mx16    <= 16'd0;
      stat_v  <= 1'b0;
    end else begin
      if (x_v) begin
        run_min <= new_min;
        run_max <= new_max;
        run_any <= new_any;
      end
      stat_v <= x_v && x_last;
      if (x_v && x_last) begin
        mn16 <= new_any ? unkey16(new_min) : 16'd0;
        mx16 <= new_any ? unkey16(new_max) : 16'd0;
      end
    end
  end

  // ---- scale path: mx - mn, / (2^b - 1), fp32 -> fp16 ------------------------------------------
  wire [31:0] mn32 = f16_to_f32(mn16);
  wire [31:0] diff;
  fp32_add u_diff (
      .a(f16_to_f32(mx16)),
      .b({~mn32[31], mn32[30:0]}),
      .y(diff)
  );
  reg [31:0] diff_r;
  reg        diff_v;
  reg [15:0] diff_mn;
  always @(posedge clk) begin
    if (rst) begin
      diff_r  <= 32'd0;
      diff_v  <= 1'b0;
      diff_mn <= 16'd0;
    end else begin
      diff_r  <= diff;
      diff_v  <= stat_v;
      diff_mn <= mn16;
    end
  end
  wire [31:0] scale_q;
  fp32_div #(
      .STEP(DIV_STEP)
  ) u_scale_div (
      .clk(clk),
      .a  (diff_r),
      .b  (QMAX_F32),
      .y  (scale_q)
  );
  wire [16:0] meta_side;
  delay_line #(
      .WIDTH(17),
      .DEPTH(DL)
  ) u_meta_delay (
      .clk(clk),
      .rst(rst),
      .d  ({diff_v, diff_mn}),
      .q  (meta_side)
  );
  wire [15:0] scale16_next = f32_to_f16(scale_q);
  reg  [15:0] scale16, zero16;
  reg  [31:0] scale32, zero32;
  always @(posedge clk) begin
    if (rst) begin
      scale16 <= 16'd0;
      zero16  <= 16'd0;
      scale32 <= 32'd0;
      zero32  <= 32'd0;
    end else if (meta_side[16]) begin
      scale16 <= scale16_next;
      zero16  <= meta_side[15:0];
      scale32 <= f16_to_f32(scale16_next);
      zero32  <= f16_to_f32(meta_side[15:0]);
    end
  end

  // ---- pass 2: the beats again, one vector slot later -------------------------------------------
  wire [TAGW+LANES*16-1:0] p2;
  delay_line #(
      .WIDTH(TAGW + LANES * 16),
      .DEPTH(PV + DL + 2)
  ) u_pass2_delay (
      .clk(clk),
      .rst(rst),
      .d  ({x_v, x_last, x_jlast, mask, x_r}),
      .q  (p2)
  );
  wire [LANES*16-1:0] p2_x = p2[LANES*16-1:0];
  wire [  TAGW-1:0] p2_tag = p2[TAGW+LANES*16-1-:TAGW];  // {valid, last, jlast, mask}

  // edge c: x - zero per lane; tags and metadata ride a delay line beside the dividers
  wire [LANES*32-1:0] sub;
  reg  [LANES*32-1:0] sub_r;
  reg  [        31:0] div_scale;
  always @(posedge clk) begin
    sub_r     <= sub;
    div_scale <= scale32;
  end
  localparam integer SIDEW = TAGW + 33;
  wire [SIDEW-1:0] side_q;
  delay_line #(
      .WIDTH(SIDEW),
      .DEPTH(DL + 1)
  ) u_side_delay (
      .clk(clk),
      .rst(rst),
      .d  ({p2_tag, scale16 == 16'd0, scale16, zero16}),
      .q  (side_q)
  );
  wire [LANES*32-1:0] quot;
  wire [LANES*8-1:0] codes;
  genvar l;
  generate
    for (l = 0; l < LANES; l = l + 1) begin : g_lane
      wire [31:0] xl = f16_to_f32(p2_x[16*l+:16]);
      fp32_add u_sub (
          .a(xl),
          .b({~zero32[31], zero32[30:0]}),
          .y(sub[32*l+:32])
      );
      fp32_div #(
          .STEP(DIV_STEP)
      ) u_div (
          .clk(clk),
          .a  (sub_r[32*l+:32]),
          .b  (div_scale),
          .y  (quot[32*l+:32])
      );
      // An outlier, or a constant vector (scale 0), gets code 0.
      assign codes[8*l+:8] = (side_q[33+l] || side_q[32]) ? 8'd0 : to_code(quot[32*l+:32]);
    end
  endgenerate

  // ---- output register, done ----------------------------------------------------------------
  wire o_v = side_q[SIDEW-1];
  wire o_last = side_q[SIDEW-2];
  wire o_jlast = side_q[SIDEW-3];
  reg [LANES*BITS-1:0] packed_codes;
  integer k;
  always @(*) begin
    for (k = 0; k < LANES; k = k + 1) packed_codes[BITS*k+:BITS] = codes[8*k+:BITS];
  end

  always @(posedge clk) begin
    if (rst) begin
      busy    <= 1'b0;
      done    <= 1'b0;
      sc      <= 32'd0;
      vc      <= 16'd0;
      nv      <= 16'd0;
      lo_r    <= 32'd0;
      hi_r    <= 32'd0;
      q_valid <= 1'b0;
      q_last  <= 1'b0;
      q_codes <= {LANES * BITS{1'b0}};
      q_scale <= 16'd0;
      q_zero  <= 16'd0;
    end else begin
      if (accept) begin
        busy <= 1'b1;
        nv   <= n_vec;
        lo_r <= lo;
        hi_r <= hi;
      end
      if (active) begin
        sc <= slot_end ? 32'd0 : sc_now + 32'd1;
        vc <= slot_end ? vc_now + 16'd1 : vc_now;
      end
      q_valid <= o_v;
      q_last  <= o_v && o_last;
      q_codes <= o_v ? packed_codes : {LANES * BITS{1'b0}};
      q_scale <= o_v ? side_q[31:16] : 16'd0;
      q_zero  <= o_v ? side_q[15:0] : 16'd0;
      done    <= o_v && o_jlast;
      if (o_v && o_jlast) busy <= 1'b0;
    end
  end

  // ---- outlier list and emitter (OAKEN) -------------------------------------------------------
  generate
    if (OAKEN != 0) begin : g_outliers
      reg [EP*32-1:0] cslots, nslots, eslots;
      reg [     31:0] ccnt, ncnt, ecnt, erem;  // collected, collected incl. this beat, sent, to send
      reg [     15:0] ecyc;
      integer li, si, p;
      // Append this beat's outliers ({position, value} per slot) in position order.
      always @(*) begin
        nslots = x_first ? {EP * 32{1'b0}} : cslots;
        ncnt   = x_first ? 32'd0 : ccnt;
        for (li = 0; li < LANES; li = li + 1) begin
          if (x_v && mask[li]) begin
            for (si = 0; si < MO; si = si + 1)
              if (ncnt == si) nslots[32*si+:32] = {x_beat * LANES[15:0] + li[15:0], x_r[16*li+:16]};
            ncnt = ncnt + 32'd1;
          end
        end
        ecnt = (ncnt > MAX_OUT) ? MAX_OUT : ncnt;
      end
      always @(posedge clk) begin
        if (rst) begin
          cslots   <= {EP * 32{1'b0}};
          eslots   <= {EP * 32{1'b0}};
          ccnt     <= 32'd0;
          erem     <= 32'd0;
          ecyc     <= 16'd0;
          ol_first <= 1'b0;
          ol_ovf   <= 1'b0;
          ol_valid <= {OUT_PORTS{1'b0}};
          ol_pos   <= {OUT_PORTS * 16{1'b0}};
          ol_val   <= {OUT_PORTS * 16{1'b0}};
        end else begin
          if (x_v) begin
            cslots <= nslots;
            ccnt   <= ncnt;
          end
          ol_first <= x_v && x_last;
          ol_ovf   <= x_v && x_last && (ncnt > MAX_OUT);
          if (x_v && x_last) begin  // the vector closes: its window starts now
            for (p = 0; p < OUT_PORTS; p = p + 1) begin
              ol_valid[p]       <= p < ecnt;
              ol_pos[16*p+:16]  <= nslots[32*p+16+:16];
              ol_val[16*p+:16]  <= nslots[32*p+:16];
            end
            eslots <= nslots >> (32 * OUT_PORTS);
            erem   <= ecnt;  // eslots' bottom entry is entry OUT_PORTS of this list
            ecyc   <= OC[15:0] - 16'd1;
          end else if (ecyc != 16'd0) begin
            for (p = 0; p < OUT_PORTS; p = p + 1) begin
              ol_valid[p]       <= (p + OUT_PORTS) < erem;
              ol_pos[16*p+:16]  <= eslots[32*p+16+:16];
              ol_val[16*p+:16]  <= eslots[32*p+:16];
            end
            eslots <= eslots >> (32 * OUT_PORTS);
            erem   <= (erem > OUT_PORTS) ? erem - OUT_PORTS : 32'd0;
            ecyc   <= ecyc - 16'd1;
          end else begin
            ol_valid <= {OUT_PORTS{1'b0}};
          end
        end
      end
    end else begin : g_no_outliers
      always @(posedge clk) begin
        ol_first <= 1'b0;
        ol_ovf   <= 1'b0;
        ol_valid <= {OUT_PORTS{1'b0}};
        ol_pos   <= {OUT_PORTS * 16{1'b0}};
        ol_val   <= {OUT_PORTS * 16{1'b0}};
      end
    end
  endgenerate
endmodule

`default_nettype wire
