"""The Xing4.0 forward pass of spec/MODEL.md §3 in PyTorch, for training and as an oracle; with
`hc_mult` absent it is the deepseek2 trunk (a plain residual stream), with `q_lora_rank` null the
query is projected directly (`attn_q`), and with `scoring_func` softmax the router is
DeepSeek-V2's (softmax scores, no selection bias).

Parameters carry the GGUF tensor names (`blk.3.attn_q_a.weight`) and the PyTorch shape, which is
the GGUF `ne` reversed (a linear layer is `[out, in]`). The attention is computed in the expanded
form (keys and values up-projected per head), which is algebraically the absorbed form the
runtime runs (spec §3.5); routed experts are computed for every token and weighted by the router's
sparse weights, which is the same sum as running only the chosen ones.
"""

import json
import math
import struct

import torch
import torch.nn.functional as F
from torch import nn


class Config:
    """The dimensions, read from a release-style config.json (what make-model writes)."""

    def __init__(self, c):
        self.vocab = c["vocab_size"]
        self.embd = c["hidden_size"]
        self.n_layer = c["num_hidden_layers"]
        self.n_nextn = c.get("num_nextn_predict_layers", 0)
        self.n_dense = c["first_k_dense_replace"]
        self.n_head = c["num_attention_heads"]
        self.q_lora = c.get("q_lora_rank") or 0
        self.kv_lora = c["kv_lora_rank"]
        self.nope = c["qk_nope_head_dim"]
        self.rope = c["qk_rope_head_dim"]
        self.v_head = c["v_head_dim"]
        self.n_ff = c["intermediate_size"]
        self.n_ff_exp = c["moe_intermediate_size"]
        self.n_expert = c["n_routed_experts"]
        self.n_used = c["num_experts_per_tok"]
        self.n_shared = c["n_shared_experts"]
        self.eps = c["rms_norm_eps"]
        self.theta = c["rope_theta"]
        y = c.get("rope_scaling") or {}
        self.yarn_factor = y.get("factor", 1.0)
        self.yarn_orig = y.get("original_max_position_embeddings", c["max_position_embeddings"])
        self.beta_fast = y.get("beta_fast", 32.0)
        self.beta_slow = y.get("beta_slow", 1.0)
        self.mscale_all_dim = y.get("mscale_all_dim", 0.0)
        self.mscale = y.get("mscale", 1.0)
        self.hc = c.get("hc_mult", 0)
        self.sinkhorn_iters = c.get("hc_sinkhorn_iters", 0)
        self.hc_eps = c.get("hc_eps", 0.0)
        self.clamp = c.get("mhc_h_res_clamp_max", 30.0)
        self.routed_scale = c["routed_scaling_factor"]
        self.norm_topk = c["norm_topk_prob"]
        self.softmax = c["scoring_func"] == "softmax"
        assert self.softmax or c["scoring_func"] == "sigmoid", c["scoring_func"]

    @staticmethod
    def load(path):
        with open(path) as f:
            return Config(json.load(f))


def tensor_shapes(cfg):
    """Every tensor of the checkpoint in PyTorch shape (GGUF `ne` reversed), in file order,
    with the rule its initial values follow."""
    e, v = cfg.embd, cfg.vocab
    out = [("token_embd.weight", (v, e), "embedding")]
    mix = (2 + cfg.hc) * cfg.hc
    qk = cfg.nope + cfg.rope
    for i in range(cfg.n_layer + cfg.n_nextn):
        b = f"blk.{i}."
        nextn = i >= cfg.n_layer
        if not nextn and cfg.hc:
            for s in ("hc_attn", "hc_ffn"):
                out += [
                    (f"{b}{s}_fn.weight", (mix, cfg.hc * e), "hc_fn"),
                    (f"{b}{s}_base.weight", (mix,), "hc_base"),
                    (f"{b}{s}_scale.weight", (3,), "ones"),
                ]
        out += [(b + "attn_norm.weight", (e,), "ones")]
        if cfg.q_lora:
            out += [
                (b + "attn_q_a.weight", (cfg.q_lora, e), "linear"),
                (b + "attn_q_a_norm.weight", (cfg.q_lora,), "ones"),
                (b + "attn_q_b.weight", (cfg.n_head * qk, cfg.q_lora), "linear"),
            ]
        else:
            out += [(b + "attn_q.weight", (cfg.n_head * qk, e), "linear")]
        out += [
            (b + "attn_kv_a_mqa.weight", (cfg.kv_lora + cfg.rope, e), "linear"),
            (b + "attn_kv_a_norm.weight", (cfg.kv_lora,), "ones"),
            (b + "attn_k_b.weight", (cfg.n_head, cfg.kv_lora, cfg.nope), "k_b"),
            (b + "attn_v_b.weight", (cfg.n_head, cfg.v_head, cfg.kv_lora), "linear"),
            (b + "attn_output.weight", (e, cfg.n_head * cfg.v_head), "out"),
            (b + "ffn_norm.weight", (e,), "ones"),
        ]
        if i < cfg.n_dense:
            out += [
                (b + "ffn_gate.weight", (cfg.n_ff, e), "linear"),
                (b + "ffn_up.weight", (cfg.n_ff, e), "linear"),
                (b + "ffn_down.weight", (e, cfg.n_ff), "out"),
            ]
        else:
            f, n = cfg.n_ff_exp, cfg.n_expert
            out += [(b + "ffn_gate_inp.weight", (n, e), "linear")]
            if not cfg.softmax:
                out += [(b + "exp_probs_b.bias", (n,), "zeros")]
            out += [
                (b + "ffn_gate_exps.weight", (n, f, e), "linear"),
                (b + "ffn_up_exps.weight", (n, f, e), "linear"),
                (b + "ffn_down_exps.weight", (n, e, f), "out"),
            ]
            if cfg.n_shared:
                fs = f * cfg.n_shared
                out += [
                    (b + "ffn_gate_shexp.weight", (fs, e), "linear"),
                    (b + "ffn_up_shexp.weight", (fs, e), "linear"),
                    (b + "ffn_down_shexp.weight", (e, fs), "out"),
                ]
        if nextn:
            out += [
                (b + "nextn.eh_proj.weight", (e, 2 * e), "linear"),
                (b + "nextn.enorm.weight", (e,), "ones"),
                (b + "nextn.hnorm.weight", (e,), "ones"),
                (b + "nextn.embed_tokens.weight", (v, e), "embedding"),
                (b + "nextn.shared_head_head.weight", (v, e), "linear"),
                (b + "nextn.shared_head_norm.weight", (e,), "ones"),
            ]
    out += [("output_norm.weight", (e,), "ones"), ("output.weight", (v, e), "linear")]
    return out


def rms(x, w, eps):
    """`x · (mean(x²) + ε)^-1/2 ⊙ w`, statistics in f32."""
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.float()


def yarn_rope_table(cfg, n_pos, device):
    """cos and sin `[n_pos, rope/2]` of llama.cpp's YaRN rope (spec §3.5), and kq_scale."""
    n_rot = cfg.rope
    factor = cfg.yarn_factor if cfg.yarn_factor else 1.0

    def corr(n):
        return n_rot * math.log(cfg.yarn_orig / (n * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low = max(0.0, math.floor(corr(cfg.beta_fast)))
    high = min(n_rot - 1.0, math.ceil(corr(cfg.beta_slow)))
    i = torch.arange(n_rot // 2, dtype=torch.float64)
    ramp = 1 - ((i - low) / max(0.001, high - low)).clamp(0, 1)
    inv = cfg.theta ** (-2.0 * i / n_rot)
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    extrap = pos * inv
    theta = extrap / factor * (1 - ramp) + extrap * ramp
    def get_mscale(m):
        return 1.0 + 0.1 * m * math.log(factor) if factor > 1 else 1.0

    mscale = get_mscale(cfg.mscale_all_dim)
    kq_scale = mscale * mscale / math.sqrt(cfg.nope + cfg.rope)
    # cos/sin magnitude (HF): mscale(factor, mscale) / mscale(factor, mscale_all_dim); 1 here.
    g = get_mscale(cfg.mscale) / get_mscale(cfg.mscale_all_dim) if cfg.mscale_all_dim else get_mscale(cfg.mscale)
    return (theta.cos() * g).float().to(device), (theta.sin() * g).float().to(device), kq_scale


def rope(x, cos, sin):
    """Rotates adjacent pairs (x[2i], x[2i+1]) in place (llama.cpp NORM mode).
    x: [..., T, n_rot] with cos/sin [T, n_rot/2]."""
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    return torch.stack((y0, y1), dim=-1).flatten(-2).to(x.dtype)


class Xing4(nn.Module):
    def __init__(self, cfg, seed=0):
        super().__init__()
        self.cfg = cfg
        self.shapes = tensor_shapes(cfg)
        g = torch.Generator().manual_seed(seed)
        n_sub = 2 * (cfg.n_layer + cfg.n_nextn)
        for name, shape, rule in self.shapes:
            t = torch.empty(shape)
            fan_in = shape[-1]
            if rule == "embedding":
                t.normal_(0, 1.0, generator=g)
            elif rule == "linear":
                t.normal_(0, fan_in**-0.5, generator=g)
            elif rule == "k_b":
                # contracts the query's nope part (ne0 = nope) into the latent
                t.normal_(0, cfg.nope**-0.5, generator=g)
            elif rule == "out":
                t.normal_(0, fan_in**-0.5 / math.sqrt(n_sub), generator=g)
            elif rule == "hc_fn":
                t.normal_(0, 0.1 * fan_in**-0.5, generator=g)
            elif rule == "hc_base":
                t.zero_()
                # comb logits (flat index 8 + 4·d + s): near the identity at start
                for d in range(cfg.hc):
                    t[2 * cfg.hc + cfg.hc * d + d] = 3.0
            elif rule == "ones":
                t.fill_(1.0)
            elif rule == "zeros":
                t.zero_()
            else:
                raise ValueError(rule)
            self.register_parameter(name.replace(".", "__"), nn.Parameter(t))
        # Expert selections of the last forward, per MoE block (for the bias update).
        self.loads = {}
        # Dropout on sub-layer outputs while training (not part of the model's function).
        self.dropout = 0.0

    def w(self, name):
        return getattr(self, name.replace(".", "__"))

    def named_weights(self):
        for name, _, _ in self.shapes:
            yield name, self.w(name)

    # --- sub-layers -------------------------------------------------------------------------

    def hc_pre(self, H, prefix):
        """H: [N, hc, E] f32 -> x [N, E], post [N, hc], C [N, hc(d), hc(s)] (spec §3.2-3.4)."""
        cfg = self.cfg
        n, hc, e = H.shape
        fn = self.w(prefix + "_fn.weight").float()
        base = self.w(prefix + "_base.weight").float()
        scale = self.w(prefix + "_scale.weight").float()
        with torch.autocast(H.device.type, enabled=False):
            f = H.reshape(n, hc * e).float()
            f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + cfg.eps)
            m = f @ fn.t()
            pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc])
            post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
            lg = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(n, hc, hc)
            lg = lg.clamp(-cfg.clamp, cfg.clamp)
            c = torch.exp(lg - lg.amax(-1, keepdim=True))
            for _ in range(cfg.sinkhorn_iters):
                c = c / (c.sum(-1, keepdim=True) + cfg.hc_eps)
                c = c / (c.sum(-2, keepdim=True) + cfg.hc_eps)
            x = (pre.unsqueeze(-1) * H).sum(1)
        return x, post, c

    @staticmethod
    def hc_post(y, H, post, c):
        return post.unsqueeze(-1) * y.float().unsqueeze(1) + c @ H

    def attention(self, a, b, cos, sin, kq_scale):
        """a: [B, T, E] (already normed) -> [B, T, E]."""
        cfg = self.cfg
        B, T, _ = a.shape
        H, nope, rp = cfg.n_head, cfg.nope, cfg.rope
        if cfg.q_lora:
            qa = rms(a @ self.w(b + "attn_q_a.weight").t(), self.w(b + "attn_q_a_norm.weight"), cfg.eps)
            q = (qa.to(a.dtype) @ self.w(b + "attn_q_b.weight").t()).view(B, T, H, nope + rp)
        else:
            q = (a @ self.w(b + "attn_q.weight").t()).view(B, T, H, nope + rp)
        q = q.transpose(1, 2)  # [B, H, T, qk]
        kv = a @ self.w(b + "attn_kv_a_mqa.weight").t()
        ckv = rms(kv[..., : cfg.kv_lora], self.w(b + "attn_kv_a_norm.weight"), cfg.eps).to(a.dtype)
        k_pe = rope(kv[..., cfg.kv_lora :], cos, sin).unsqueeze(1)  # [B, 1, T, rope]
        q_pe = rope(q[..., nope:], cos, sin)
        kb = self.w(b + "attn_k_b.weight")  # [H, kv_lora, nope]
        vb = self.w(b + "attn_v_b.weight")  # [H, v, kv_lora]
        k_nope = torch.einsum("btc,hcd->bhtd", ckv, kb.to(ckv.dtype))
        v = torch.einsum("btc,hjc->bhtj", ckv, vb.to(ckv.dtype))
        qf = torch.cat((q[..., :nope], q_pe), -1)
        kf = torch.cat((k_nope, k_pe.expand(B, H, T, rp).to(k_nope.dtype)), -1)
        o = F.scaled_dot_product_attention(qf, kf.to(qf.dtype), v.to(qf.dtype), is_causal=True, scale=kq_scale)
        o = o.transpose(1, 2).reshape(B, T, H * cfg.v_head)
        return o @ self.w(b + "attn_output.weight").t()

    def ffn(self, z, i):
        b = f"blk.{i}."
        if i < self.cfg.n_dense:
            g = z @ self.w(b + "ffn_gate.weight").t()
            u = z @ self.w(b + "ffn_up.weight").t()
            return (F.silu(g) * u) @ self.w(b + "ffn_down.weight").t()
        return self.moe(z, b)

    def moe(self, z, b):
        cfg = self.cfg
        shape = z.shape
        z = z.reshape(-1, shape[-1])
        with torch.autocast(z.device.type, enabled=False):
            logits = z.float() @ self.w(b + "ffn_gate_inp.weight").float().t()
            if cfg.softmax:
                p = torch.softmax(logits, -1)
                sel = p
            else:
                p = torch.sigmoid(logits)
                sel = p + self.w(b + "exp_probs_b.bias").float().detach()
            top = sel.topk(cfg.n_used, dim=-1).indices
            wk = p.gather(1, top)
            if cfg.norm_topk:
                wk = wk / wk.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
            wk = wk * cfg.routed_scale
            weights = torch.zeros_like(p).scatter(1, top, wk)
        if self.training:
            self.loads[b] = torch.bincount(top.flatten(), minlength=cfg.n_expert)
        g = torch.einsum("nd,efd->nef", z, self.w(b + "ffn_gate_exps.weight").to(z.dtype))
        u = torch.einsum("nd,efd->nef", z, self.w(b + "ffn_up_exps.weight").to(z.dtype))
        r = torch.einsum("nef,edf->ned", F.silu(g) * u, self.w(b + "ffn_down_exps.weight").to(z.dtype))
        y = (weights.unsqueeze(-1).to(r.dtype) * r).sum(1)
        if cfg.n_shared:
            gs = z @ self.w(b + "ffn_gate_shexp.weight").t()
            us = z @ self.w(b + "ffn_up_shexp.weight").t()
            y = y + (F.silu(gs) * us) @ self.w(b + "ffn_down_shexp.weight").t()
        return y.reshape(*shape[:-1], -1)

    def drop(self, y):
        return F.dropout(y, self.dropout, self.training) if self.dropout else y

    # --- the model --------------------------------------------------------------------------

    def forward(self, tokens, next_tokens=None):
        """tokens [B, T] -> logits [B, T, vocab] (f32); with `next_tokens` [B, T] (the token
        after each position's target) also the NextN block's logits for the token after next."""
        cfg = self.cfg
        B, T = tokens.shape
        cos, sin, kq_scale = yarn_rope_table(cfg, T, tokens.device)
        dt = torch.get_autocast_dtype(tokens.device.type) if torch.is_autocast_enabled(tokens.device.type) else torch.float32
        e = self.w("token_embd.weight")[tokens].float()  # [B, T, E]
        if not cfg.hc:
            return self.plain_forward(e, cos, sin, kq_scale, dt)
        Hs = e.reshape(B * T, 1, cfg.embd).expand(B * T, cfg.hc, cfg.embd).contiguous()
        for i in range(cfg.n_layer):
            b = f"blk.{i}."
            x, post, c = self.hc_pre(Hs, b + "hc_attn")
            a = rms(x, self.w(b + "attn_norm.weight"), cfg.eps).to(dt).view(B, T, -1)
            y = self.attention(a, b, cos, sin, kq_scale).reshape(B * T, -1)
            Hs = self.hc_post(self.drop(y), Hs, post, c)
            x, post, c = self.hc_pre(Hs, b + "hc_ffn")
            z = rms(x, self.w(b + "ffn_norm.weight"), cfg.eps).to(dt)
            Hs = self.hc_post(self.drop(self.ffn(z, i)), Hs, post, c)
        h = Hs.mean(1)  # [B*T, E] (the spec's ((H0+H1)+H2)+H3)·0.25, up to rounding)
        logits = rms(h, self.w("output_norm.weight"), cfg.eps).to(dt) @ self.w("output.weight").t()
        logits = logits.float().view(B, T, -1)
        if next_tokens is None or cfg.n_nextn == 0:
            return logits
        return logits, self.nextn(h.view(B, T, -1), next_tokens, cos, sin, kq_scale, dt)

    def plain_forward(self, x, cos, sin, kq_scale, dt):
        """The deepseek2 trunk: one f32 residual stream, pre-norm sub-layers."""
        cfg = self.cfg
        B, T, _ = x.shape
        for i in range(cfg.n_layer):
            b = f"blk.{i}."
            a = rms(x, self.w(b + "attn_norm.weight"), cfg.eps).to(dt)
            x = x + self.drop(self.attention(a, b, cos, sin, kq_scale)).float()
            z = rms(x, self.w(b + "ffn_norm.weight"), cfg.eps).to(dt)
            x = x + self.drop(self.ffn(z, i)).float()
        logits = rms(x, self.w("output_norm.weight"), cfg.eps).to(dt) @ self.w("output.weight").t()
        return logits.float()

    def nextn(self, h, next_tokens, cos, sin, kq_scale, dt):
        """The NextN (MTP) block (DeepSeek-V3's): the trunk's hidden state at t and the
        embedding of token t+1 predict token t+2. No hyper-connections: a plain residual."""
        cfg = self.cfg
        i = cfg.n_layer
        b = f"blk.{i}."
        emb = self.w(b + "nextn.embed_tokens.weight")[next_tokens].float()
        cat = torch.cat(
            (rms(emb, self.w(b + "nextn.enorm.weight"), cfg.eps), rms(h, self.w(b + "nextn.hnorm.weight"), cfg.eps)),
            -1,
        ).to(dt)
        x = (cat @ self.w(b + "nextn.eh_proj.weight").t()).float()
        x = x + self.drop(self.attention(rms(x, self.w(b + "attn_norm.weight"), cfg.eps).to(dt), b, cos, sin, kq_scale)).float()
        x = x + self.drop(self.ffn(rms(x, self.w(b + "ffn_norm.weight"), cfg.eps).to(dt), i)).float()
        out = rms(x, self.w(b + "nextn.shared_head_norm.weight"), cfg.eps).to(dt)
        return (out @ self.w(b + "nextn.shared_head_head.weight").t()).float()


# --- files ----------------------------------------------------------------------------------


def save_safetensors(path, named):
    """Writes F32 tensors (name -> tensor) as safetensors."""
    header, blobs, off = {}, [], 0
    for name, t in named:
        data = t.detach().float().contiguous().cpu().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for d in blobs:
            f.write(d)


def load_gguf_weights(model, path):
    """Loads a GGUF's tensors, dequantized to f32 with the `gguf` package, into `model`."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    got = {}
    for t in reader.tensors:
        vals = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        got[t.name] = torch.from_numpy(np.ascontiguousarray(vals, dtype=np.float32).reshape(shape))
    with torch.no_grad():
        for name, p in model.named_weights():
            if name not in got:
                raise KeyError(f"{path}: no tensor {name}")
            if tuple(got[name].shape) != tuple(p.shape):
                raise ValueError(f"{path}: {name} has shape {tuple(got[name].shape)}, expected {tuple(p.shape)}")
            p.copy_(got[name])
