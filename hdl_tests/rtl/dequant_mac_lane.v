// dequant_mac_lane: LANES int4 dequant-MAC lanes (the W4A16 GEMV datapath of an accelerator).
//
// One job computes, for each lane l, the exact integer
//     y[l] = sum_g scale[l][g] * sum_{k in group g} x[k] * (code[l][k] - zero[l][g])
// with int16 activations x (shared by all lanes), uint4 codes, a uint4 zero point and an int16
// scale per group of GROUP codes (symmetric int4 is zero = 8). Real values follow from the fixed
// points of x and scale; accel_model/dequant_mac.py is the model.
//
// Interface contract (no back-pressure):
//   * `start` is accepted on an edge where busy is low and n_groups != 0; call it edge 0.
//     Word w (P = CPC activations in x_vec, lane l's P codes in q_vec[l*4*P +: 4*P], element i
//     in the low bits first) must be on the inputs at edge w, w = 0 .. W-1 with
//     W = n_groups * GROUP / CPC. scale_vec/zero_vec (16 / 4 bits per lane) must hold group
//     g's values with every word of group g. Inputs outside that window are ignored.
//   * Pipeline: edge w registers word w; edge w+1 registers its P-term dot product per lane;
//     on the group's last word, edge w+2 registers group_sum * scale; edge w+3 adds that into
//     the 64-bit accumulator. After the last word (w = W-1) the accumulate at edge W+2 also
//     writes out_data and pulses `done`: start -> done = W + 3 cycles.
//
// FAULT (bench teeth only): 1 = group counter off by one (scale/zero switch one word late),
// 2 = zero point not subtracted.
`default_nettype none

module dequant_mac_lane #(
    parameter integer LANES = 2,
    parameter integer CPC   = 4,   // codes (and activations) per cycle
    parameter integer GROUP = 8,   // codes per scale group, a multiple of CPC
    parameter integer FAULT = 0
) (
    input  wire                  clk,
    input  wire                  rst,
    input  wire                  start,
    input  wire [          15:0] n_groups,
    input  wire [    CPC*16-1:0] x_vec,
    input  wire [LANES*CPC*4-1:0] q_vec,
    input  wire [  LANES*16-1:0] scale_vec,
    input  wire [   LANES*4-1:0] zero_vec,
    output reg                   busy,
    output reg                   done,
    output reg  [  LANES*64-1:0] out_data
);
  localparam integer WPG = GROUP / CPC;  // words per group

  // ---- control: word counter and group position ---------------------------
  wire        accept = start && !busy && (n_groups != 16'd0);
  reg  [31:0] wcnt;  // index of the word expected at the coming edge
  reg  [31:0] n_words;
  reg  [31:0] gpos;  // word index inside its group, for the coming edge
  wire        feed = accept || (busy && wcnt < n_words);
  wire [31:0] words_now = accept ? n_groups * WPG : n_words;
  wire [31:0] gpos_now = accept ? 32'd0 : gpos;
  wire        j_last = (accept ? 32'd0 : wcnt) == words_now - 32'd1;
  // The job's last word always closes a group. FAULT 1: other groups end one word late.
  wire        g_last = j_last || (gpos_now == WPG - 1 + ((FAULT == 1) ? 1 : 0));

  // ---- stage 0: input register ------------------------------------------
  reg [    CPC*16-1:0] x_r;
  reg [LANES*CPC*4-1:0] q_r;
  reg [  LANES*16-1:0] s_r;
  reg [   LANES*4-1:0] z_r;
  reg                  v_r, gfirst_r, glast_r, jfirst_r, jlast_r;
  always @(posedge clk) begin
    if (rst) begin
      x_r <= {CPC * 16{1'b0}};
      q_r <= {LANES * CPC * 4{1'b0}};
      s_r <= {LANES * 16{1'b0}};
      z_r <= {LANES * 4{1'b0}};
      {v_r, gfirst_r, glast_r, jfirst_r, jlast_r} <= 5'd0;
    end else begin
      x_r      <= feed ? x_vec : {CPC * 16{1'b0}};
      q_r      <= feed ? q_vec : {LANES * CPC * 4{1'b0}};
      s_r      <= feed ? scale_vec : {LANES * 16{1'b0}};
      z_r      <= feed ? zero_vec : {LANES * 4{1'b0}};
      v_r      <= feed;
      gfirst_r <= feed && (gpos_now == 32'd0);
      glast_r  <= feed && g_last;
      jfirst_r <= accept;
      jlast_r  <= feed && j_last;
    end
  end

  // ---- stages 1..3 per lane ---------------------------------------------
  reg v1, gfirst1, glast1, jfirst1, jlast1;
  reg v2, jfirst2, jlast2;
  always @(posedge clk) begin
    if (rst) begin
      {v1, gfirst1, glast1, jfirst1, jlast1} <= 5'd0;
      {v2, jfirst2, jlast2} <= 3'd0;
    end else begin
      {v1, gfirst1, glast1, jfirst1, jlast1} <= {v_r, gfirst_r, glast_r, jfirst_r, jlast_r};
      v2 <= v1 && glast1;
      // the job's first group starts with the job's first word; jlast rides to the last group end
      if (v1 && gfirst1) jfirst2 <= jfirst1;
      jlast2 <= v1 && glast1 && jlast1;
    end
  end

  wire [LANES*64-1:0] acc_next;
  genvar l;
  generate
    for (l = 0; l < LANES; l = l + 1) begin : g_lane
      // stage 1: P-term dot product of activations and de-zeroed codes
      wire signed [5:0] zero6 = (FAULT == 2) ? 6'sd0 : $signed({2'b00, z_r[l*4+:4]});
      reg signed [31:0] dot;
      reg signed [ 5:0] d;  // code - zero, in [-15, 15]
      reg signed [21:0] p;  // int16 x 6-bit
      integer i;
      always @(*) begin
        dot = 32'sd0;
        for (i = 0; i < CPC; i = i + 1) begin
          d   = $signed({2'b00, q_r[(l*CPC+i)*4+:4]}) - zero6;
          p   = $signed(x_r[16*i+:16]) * d;
          dot = dot + {{10{p[21]}}, p};
        end
      end
      reg signed [31:0] dot_r;
      reg signed [15:0] s1;
      // stage 2: group sum, scaled on the group's last word
      reg signed [31:0] gacc;
      wire signed [31:0] gsum = (gfirst1 ? 32'sd0 : gacc) + dot_r;
      reg signed [63:0] scaled_r;
      // stage 3: job accumulator
      reg signed [63:0] acc;
      wire signed [63:0] acc_sum = (jfirst2 ? 64'sd0 : acc) + scaled_r;
      assign acc_next[l*64+:64] = acc_sum;
      always @(posedge clk) begin
        if (rst) begin
          dot_r    <= 32'sd0;
          s1       <= 16'sd0;
          gacc     <= 32'sd0;
          scaled_r <= 64'sd0;
          acc      <= 64'sd0;
        end else begin
          dot_r <= dot;
          s1    <= $signed(s_r[l*16+:16]);
          if (v1) gacc <= gsum;
          if (v1 && glast1) scaled_r <= {{32{gsum[31]}}, gsum} * {{48{s1[15]}}, s1};
          if (v2) acc <= acc_sum;
        end
      end
    end
  endgenerate

  // ---- job control and output -------------------------------------------
  always @(posedge clk) begin
    if (rst) begin
      busy     <= 1'b0;
      done     <= 1'b0;
      out_data <= {LANES * 64{1'b0}};
      wcnt     <= 32'd0;
      n_words  <= 32'd0;
      gpos     <= 32'd0;
    end else begin
      done <= 1'b0;
      if (feed) begin
        wcnt <= (accept ? 32'd0 : wcnt) + 32'd1;
        gpos <= g_last ? 32'd0 : gpos_now + 32'd1;
      end
      if (accept) begin
        busy    <= 1'b1;
        n_words <= words_now;
      end else if (busy && v2 && jlast2) begin
        out_data <= acc_next;
        done     <= 1'b1;
        busy     <= 1'b0;
      end
    end
  end
endmodule

`default_nettype wire
