"""Plain eager-PyTorch implementations of SPEC.md, written from the text and nothing else: the
obvious, slow twins the extension is tested against. Gradients come from PyTorch's autograd
through these formulas, so they are independent of the library's hand-derived backward passes.
"""

import math

import torch
import torch.nn.functional as F


def gma_responsibilities(x, mean, var_raw, prior_logit, var_floor=1e-4):
    """SPEC 1.2: gamma_ik = softmax_k(log pi_k + log N(x_i; mu_k, diag sigma_k^2)) without the
    constant -r/2 log 2 pi (it cancels); x (B,H,N,r), mixture (H,K,r), (H,K) -> (B,H,N,K)."""
    var = F.softplus(var_raw) + var_floor                          # (H, K, r)
    log_pi = torch.log_softmax(prior_logit, -1)                    # (H, K)
    diff = x[:, :, :, None, :] - mean[None, :, None, :, :]
    s = (log_pi[None, :, None, :] - 0.5 * torch.log(var).sum(-1)[None, :, None, :]
         - 0.5 * (diff * diff / var[None, :, None, :, :]).sum(-1))
    return torch.softmax(s, -1)


def gma(q, k, v, mean, var_raw, prior_logit, causal=False, eps=1e-6, var_floor=1e-4):
    """SPEC 1.2-1.4 in its exactness-oracle form O = diag(d)^-1 (mask o Gamma_Q Gamma_K^T) V,
    d = rowsum(mask o Gamma_Q Gamma_K^T) + eps; q (B,H,N,r), mixture (H,K,r), (H,K)."""
    def gamma(x):                                                  # (B, H, N, K)
        return gma_responsibilities(x, mean, var_raw, prior_logit, var_floor)

    a = gamma(q) @ gamma(k).transpose(-1, -2)                      # (B, H, N, M)
    if causal:
        a = a * torch.ones(a.shape[-2:], dtype=torch.bool).tril()
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def gma_continued(q, k, v, mean, var_raw, prior_logit, S0, z0, eps=1e-6, var_floor=1e-4):
    """SPEC 1.4, state and pieces: the causal piece continuing (S0, z0), S0 (B,H,K,d_v),
    z0 (B,H,K), every prefix state written out: S_i = S0 + sum_{j<=i} gamma_k,j v_j^T,
    z_i = z0 + sum_{j<=i} gamma_k,j, O_i = (gamma_q,i S_i) / (gamma_q,i . z_i + eps).
    Returns (O, (S_T, z_T)), the end state being the last prefix (the start state if N = 0)."""
    gq = gma_responsibilities(q, mean, var_raw, prior_logit, var_floor)   # (B, H, N, K)
    gk = gma_responsibilities(k, mean, var_raw, prior_logit, var_floor)
    S = S0[:, :, None] + torch.cumsum(gk[..., :, None] * v[..., None, :], 2)  # (B, H, N, K, d_v)
    z = z0[:, :, None] + torch.cumsum(gk, 2)                                 # (B, H, N, K)
    out = (gq[..., :, None] * S).sum(-2) / ((gq * z).sum(-1, keepdim=True) + eps)
    if q.shape[2] == 0:
        return out, (S0, z0)
    return out, (S[:, :, -1], z[:, :, -1])


def softmax_attention(q, k, v, causal=False, scale=None):
    """SPEC 3: softmax(scale Q K^T + mask) V, scale default 1/sqrt(r)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q @ k.transpose(-1, -2))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def plateau_size(t, n_max, alpha):
    """SPEC 2.3 step 1, plateau: N(t) = min(max(floor(t N_max / (t + alpha)), 1), N_max), N(0) = 0."""
    return 0 if t == 0 else min(max(math.floor(t * n_max / (t + alpha)), 1), n_max)


def seed_picks(keys, dictionary, nu, seeding):
    """SPEC 2.3 step 2: block positions of the nu new centroids, in pick order. keys: the block's
    normalised keys (C x r), dictionary: the old key centroids; no gradient flows here."""
    picks = []
    if nu == 0:
        return picks
    if seeding == "greedy_dispersion":
        for _ in range(nu):
            centroids = torch.cat([dictionary, keys[picks]])
            if centroids.shape[0] == 0:
                picks.append(0)
                continue
            score = (keys @ centroids.t()).max(1).values
            score[picks] = float("inf")
            picks.append(int(torch.argmin(score)))  # first minimum: ties go to the lowest index
        return picks
    # one_shot: scored against the old dictionary only (or the first token when it is empty)
    if dictionary.shape[0] == 0:
        picks, reference = [0], keys[:1]
    else:
        reference = dictionary
    score = (keys @ reference.t()).max(1).values
    order = sorted((float(score[j]), j) for j in range(keys.shape[0]) if j not in picks)
    return picks + [j for _, j in order[:nu - len(picks)]]


def ovq_head(q, k, v, beta, block, max_centroids, growth, growth_alpha, seeding, count_bias,
             grad_through_dictionary, norm_eps, assignment="all_centroids"):
    """SPEC 2.2-2.4 for one head, token by token; q, k (T, r), v (T, d_v), beta a scalar."""
    t_len, r = q.shape
    qn = q / (q.norm(dim=1, keepdim=True) + norm_eps)
    kn = k / (k.norm(dim=1, keepdim=True) + norm_eps)
    s = beta * math.sqrt(r)
    dk, dv = q.new_zeros(0, r), v.new_zeros(0, v.shape[1])
    counts = []                                          # constants (SPEC 2.4)
    alpha = growth_alpha if growth_alpha > 0 else max_centroids
    size = ((lambda t: min(t, max_centroids)) if growth == "linear"
            else (lambda t: plateau_size(t, max_centroids, alpha)))
    out, absorbed = [], 0
    for start in range(0, t_len, block):
        end = min(start + block, t_len)
        use_k, use_v = (dk, dv) if grad_through_dictionary else (dk.detach(), dv.detach())
        bias = q.new_tensor([math.log(c) for c in counts]) if count_bias else q.new_zeros(len(counts))
        for i in range(start, end):
            logits = torch.cat([s * (use_k @ qn[i]) + bias, s * (kn[start:i + 1] @ qn[i])])
            p = torch.softmax(logits, 0)
            n = len(counts)
            out.append(p[:n] @ use_v + p[n:] @ v[start:i + 1])
        if end - start < block:
            break                                        # an unfinished block stays pending
        nu = size(absorbed + block) - size(absorbed)
        keys = kn[start:end].detach()
        picks = seed_picks(keys, dk.detach(), nu, seeding)
        n_old = len(counts)
        all_keys = torch.cat([dk.detach(), keys[picks]])
        members = [[] for _ in range(n_old + len(picks))]
        for j in range(block):
            if j in picks:
                members[n_old + picks.index(j)].append(j)  # a seed counts itself
            elif assignment == "existing_only":  # old centroids only; none: the first seed's
                members[int(torch.argmax(dk.detach() @ keys[j])) if n_old else 0].append(j)
            else:
                members[int(torch.argmax(all_keys @ keys[j]))].append(j)
        rows_k, rows_v, new_counts = [], [], []
        for n, js in enumerate(members):
            c_old = counts[n] if n < n_old else 0
            c_new = c_old + len(js)
            sum_k = sum((kn[start + j] for j in js), q.new_zeros(r))
            sum_v = sum((v[start + j] for j in js), v.new_zeros(v.shape[1]))
            if n < n_old:
                rows_k.append((c_old * dk[n] + sum_k) / c_new)
                rows_v.append((c_old * dv[n] + sum_v) / c_new)
            else:
                rows_k.append(sum_k / c_new)
                rows_v.append(sum_v / c_new)
            new_counts.append(c_new)
        dk, dv, counts = torch.stack(rows_k), torch.stack(rows_v), new_counts
        absorbed += block
    return torch.stack(out) if out else v.new_zeros(0, v.shape[1])


def ovq(q, k, v, beta, block=256, max_centroids=1024, growth="plateau", growth_alpha=0.0,
        seeding="greedy_dispersion", count_bias=True, grad_through_dictionary=True,
        norm_eps=1e-5, assignment="all_centroids"):
    """OVQ over (B, H, T, .) tensors, every (b, h) from an empty dictionary; beta (H,)."""
    b_len, h_len = q.shape[:2]
    heads = [[ovq_head(q[b, h], k[b, h], v[b, h], beta[h], block, max_centroids, growth,
                       growth_alpha, seeding, count_bias, grad_through_dictionary, norm_eps,
                       assignment)
              for h in range(h_len)] for b in range(b_len)]
    return torch.stack([torch.stack(row) for row in heads])


# --- the baselines (SPEC 4-7) and RoPE (SPEC 8) -------------------------------------------------

def _masked_readout(a, v, causal, eps):
    """O = diag(d)^-1 (mask o A) V, d = rowsum(mask o A) + eps (SPEC 4.2's exactness oracle);
    a (..., N, M) non-negative weights, mask j <= i when causal."""
    if causal:
        a = a * torch.ones(a.shape[-2:], dtype=torch.bool).tril()
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def linear(q, k, v, causal=False, eps=1e-6):
    """SPEC 4.1-4.2: phi(x) = elu(x) + 1 entrywise, then the masked read-out."""
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    return _masked_readout(phi_q @ phi_k.transpose(-1, -2), v, causal, eps)


def performer(q, k, v, w, causal=False, eps=1e-6, scale=None):
    """SPEC 5.2: u_l(x) = s w_l . x - s^2 |x|^2 / 2, phi(x)_l = exp(u_l(x) - c) / sqrt(m), with
    c the query row's largest exponent for q and one largest exponent over every key of the
    (b, h) call for k; then linear attention's read-out. w: (H, m, r). The maxima are
    differentiated by autograd (SPEC 5.3 keeps their gradient)."""
    r, m = q.shape[-1], w.shape[-2]
    s = r ** -0.25 if scale is None else scale

    def exponents(x):                                              # (B, H, N, m)
        return s * (x @ w.transpose(-1, -2)[None]) - s * s * (x * x).sum(-1, keepdim=True) / 2

    uq, uk = exponents(q), exponents(k)
    phi_q = torch.exp(uq - uq.amax(-1, keepdim=True)) / math.sqrt(m)
    phi_k = torch.exp(uk - uk.amax((-2, -1), keepdim=True)) / math.sqrt(m)
    return _masked_readout(phi_q @ phi_k.transpose(-1, -2), v, causal, eps)


def vq_codes(k, codebook):
    """SPEC 6.1: z_j = argmin_s |k_j - C_s|^2 (ties: the lowest s); k (B, H, M, r), codebook
    (H, S, r) -> (B, H, M)."""
    d = ((k[:, :, :, None, :] - codebook[None, :, None, :, :]) ** 2).sum(-1)
    return d.argmin(-1)


def vq(q, k, v, codebook, causal=False, eps=1e-6, scale=None):
    """SPEC 6.2 in its first form: w_ij = e^(tau q_i . k^_j - m_i) / sqrt(S),
    O_i = sum_j w_ij v_j / (sum_j w_ij + eps) over the visible j, m_i = max_s tau q_i . C_s.
    k^ = C_z carries C's exact gradient, and k's straight-through one (SPEC 6.3:
    k^ = k + stop_gradient(C_z - k), written as C_z + k - stop_gradient(k))."""
    S, r = codebook.shape[-2], q.shape[-1]
    tau = 1 / math.sqrt(r) if scale is None else scale
    z = vq_codes(k.detach(), codebook.detach())
    heads = torch.arange(codebook.shape[0])[None, :, None]
    k_hat = codebook[heads, z] + k - k.detach()                    # (B, H, M, r)
    m = (tau * q @ codebook.transpose(-1, -2)[None]).amax(-1, keepdim=True)
    w = torch.exp(tau * q @ k_hat.transpose(-1, -2) - m) / math.sqrt(S)
    return _masked_readout(w, v, causal, eps)


def sliding_window(q, k, v, window, scale=None):
    """SPEC 7.1: softmax(scale Q K^T + mask) V with mask 0 for i - w < j <= i, -inf otherwise."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q @ k.transpose(-1, -2))
    n = s.shape[-1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    s = s.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
    return torch.softmax(s, -1) @ v


def rope(x, start=0, base=10000.0):
    """SPEC 8.1: row n at position p = start + n; columns (2i, 2i + 1) rotated by p theta_i,
    theta_i = base^(-2i/r); angles, cosines and sines in float64."""
    n, r = x.shape[-2], x.shape[-1]
    p = torch.arange(start, start + n, dtype=torch.float64)[:, None]
    theta = base ** (-2 * torch.arange(r // 2, dtype=torch.float64) / r)
    c, s = torch.cos(p * theta).to(x.dtype), torch.sin(p * theta).to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)
