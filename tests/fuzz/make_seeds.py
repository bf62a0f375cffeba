#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets added with it (tests/fuzz/corpus/<target>/).

The seeds are byte strings laid out as each target's decoder reads them (a reader past the end
reads 0), so that the fuzzer starts from cases that reach the oracles: moderate double sequences
cut into pieces, every corruption of the offsets, a valid parameter file and its mutations, every
mixer's decoding. Run it from the repository root to regenerate them: the output is deterministic.
"""
import os
import random
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


def mat(seed, header=0):
    """fz::matrix: a header (scale index | edits << 3) and a u16 seed; no edits."""
    return [header, seed & 255, seed >> 8]


def gma_state():
    for name, t, kc, r, dv, n, chunk, mismatch, cuts in [
        ("double_three_pieces", 1, 3, 4, 3, 40, 0, 15, [3, 7, 11]),
        ("float_one_token_pieces", 0, 2, 2, 2, 6, 1, 15, [5, 1, 1, 1, 1]),
        ("double_into_prepared", 1, 4, 3, 2, 30, 3, 15, [2, 20]),
        ("state_of_other_shape", 1, 2, 2, 2, 10, 0, 0, [1, 4]),
        ("negative_tokens_seen", 0, 2, 2, 2, 10, 0, 2, [1, 4]),
        ("not_causal", 1, 2, 2, 2, 10, 0, 3, [1, 4]),
        ("nan_in_state", 0, 2, 2, 2, 10, 0, 4, [1, 4]),
        ("grad_state_other_state", 1, 2, 3, 2, 20, 0, 8, [2, 9]),
        ("grad_state_wrong_shape", 1, 2, 3, 2, 20, 0, 9, [2, 9]),
        ("grad_state_without_state", 1, 2, 3, 2, 20, 0, 10, [2, 9]),
        ("grad_state_own_start", 1, 2, 3, 2, 20, 0, 11, [2, 9]),
    ]:
        prepared, into = (1, 1) if "into" in name else (0, 0)
        b = [t, kc - 1, r - 1, dv - 1, n, 0, chunk, 1, prepared, into, mismatch, 0]
        for i in range(7):  # mean, var_raw, prior_logit, q, k, v, dout
            b += mat(11 + i)
        b += cuts
        write("fuzz_gma_state", name, b)


def into():
    rng = random.Random(52)
    for name, modes in [("every_mode_double", [0, 1, 2, 3, 4, 5]),
                        ("gma_then_softmax_float", [1, 3, 0, 6]),
                        ("ovq_then_gma", [2, 0, 2])]:
        t = 1 if "double" in name else 0
        b = [t, len(modes) - 1]
        for m in modes:
            b += [m, rng.randrange(41), rng.randrange(41), rng.randrange(8), rng.randrange(8), 1]
            for i in range(4):
                b += mat(rng.randrange(65536))
            b += [rng.randrange(256) for _ in range(16)]
        write("fuzz_into", name, b)


def packed():
    # op, H, [kv flag], r, d_v, [causal], [cross], threads, check_finite, B, q lengths,
    # [k lengths], empty-sequence byte, q, k, v, grad_out, corruption mode, its argument
    for op, name in [(0, "gma"), (1, "flash"), (2, "ovq")]:
        for mode, label in [(0, "valid"), (1, "decreasing"), (2, "interior_past_end"),
                            (3, "last_past_end"), (4, "first_not_zero"), (5, "one_entry"),
                            (6, "no_entry"), (7, "end_of_index"), (9, "count_mismatch")]:
            if op == 2 and mode == 9:
                continue  # one offsets vector
            for threads in (0, 2):
                b = [op % 2, op, 1] + ([0] if op != 0 else []) + [2, 2]
                if op != 2:
                    b += [0, 1]  # bidirectional, cross-attention
                b += [threads, 1, 2, 5, 0, 7] + ([3, 1, 4] if op != 2 else []) + [1]
                for i in range(4):
                    b += mat(100 + i)
                b += [mode, 5 if mode != 1 else 133]
                write("fuzz_packed", f"{name}_{label}_{'two_threads' if threads else 'one'}", b)
        write("fuzz_packed", f"{name}_empty_sequence",
              [1, op, 0] + ([1] if op != 0 else []) + [1, 1] + ([1] if op != 2 else []) +
              [0, 1, 3, 4, 0, 3, 0, 1] + mat(7) * 4 + [0, 0])
        # Three sequences, all empty (inputs of 0 rows), two query heads (sharing one key/value
        # head where the operator allows it), forward and backward.
        write("fuzz_packed", f"{name}_only_empty_sequences",
              [1, op, 1] + ([0] if op != 0 else []) + [2, 1] + ([1] if op != 2 else []) +
              [0, 1, 2, 0, 0, 0, 1] + mat(7) * 4 + [0, 0])


def baselines():
    rng = random.Random(4)
    for op in range(5):
        for t in range(2):
            for c in range(2):
                b = [t, op] + [rng.randrange(256) for _ in range(5)] + [c]
                b += [rng.randrange(256) for _ in range(40)]
                write("fuzz_baselines", f"op{op}_{'double' if t else 'float'}_{c}", b)


def param_file(blocks, scalar=4):
    out = b"MIXATTNP" + struct.pack("<IIQ", 1, scalar, len(blocks))
    for name, rows, cols in blocks:
        out += struct.pack("<I", len(name)) + name.encode() + struct.pack("<QQ", rows, cols)
        out += b"".join(struct.pack("<f" if scalar == 4 else "<d", 0.25 * (i + 1))
                        for i in range(rows * cols))
    return out


def layer_load():
    gma = [("w_q", 1, 1), ("w_k", 1, 1), ("w_v", 1, 1), ("w_o", 1, 1), ("head0.mean", 1, 1),
           ("head0.var_raw", 1, 1), ("head0.prior_logit", 1, 1)]
    # float, mixer gma, bidirectional, d = H = r = d_v = K = S = 1, seed 0, raw file
    config = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    write("fuzz_layer_load", "valid_gma_float", config + [0] + list(param_file(gma)))
    write("fuzz_layer_load", "valid_gma_as_double", [1] + config[1:] + [0] +
          list(param_file(gma, 8)))
    write("fuzz_layer_load", "float_file_for_double", [1] + config[1:] + [0] +
          list(param_file(gma)))
    ovq = [("w_q", 2, 2), ("w_k", 2, 2), ("w_v", 2, 1), ("w_o", 1, 2), ("head0.beta", 1, 1)]
    write("fuzz_layer_load", "valid_ovq", [0, 1, 1, 0, 1, 0, 0, 0, 0] + [0] +
          list(param_file(ovq)))
    # an edit: kind, u16 position, then its own bytes (field index and hostile value index,
    # count and value, or the new byte)
    for edits, label in [([1, 0, 0, 2, 4], "count_huge"), ([1, 0, 0, 4, 5], "rows_huge"),
                         ([1, 0, 0, 3, 7], "name_length_65536"), ([2, 40, 0], "cut"),
                         ([3, 0, 0, 5, 7], "trailing"), ([0, 9, 0, 3], "byte")]:
        write("fuzz_layer_load", "mutated_" + label, config + [1, 0] + edits)
    write("fuzz_layer_load", "garbage", [0] + config[1:] + [0] + list(b"MIXATTNP\x01"))
    # the gated delta rule (mixer 4, always causal: no flag byte), d = H = r = d_v = 1
    delta = [("w_q", 1, 1), ("w_k", 1, 1), ("w_v", 1, 1), ("w_o", 1, 1)] + [
        ("head0." + name, 1, 1) for name in ("w_beta", "b_beta", "w_a", "b_a", "A_log")]
    write("fuzz_layer_load", "valid_delta", [1, 4, 0, 0, 0, 0, 0, 0, 0] + [0] +
          list(param_file(delta, 8)))


def layer_decode():
    for mixer, name in [(0, "gma"), (2, "ovq"), (3, "softmax"), (5, "linear_refused"),
                        (6, "delta")]:
        for t in range(2):
            for rope in range(2):
                b = [t, mixer, 1, rope, 3, 1, 1, 2, 2, 1, 0, 3, 0, 0, 9, 20, 0, 0, 0,
                     3, 4, 5, 6, 7, 15, 1]
                write("fuzz_layer_decode", f"{name}_{'double' if t else 'float'}_rope{rope}", b)
    write("fuzz_layer_decode", "bidirectional_refused", [1, 0, 0])


def delta():
    """fuzz_delta: [double, d_k - 1, d_v - 1, n, chunk, scale, normalize, norm_eps, keep_states,
    check_finite, state, mapped gates, into, mismatch], q, k, v, g, beta, (S0), dout, the cut."""
    nan_v = [1 << 3, 7, 0, 0, 2, 1, 0]  # v with one NaN
    for name, t, dk, dv, n, chunk, norm, eps, keep, cf, state, gates, into, mismatch, cuts, v in [
        ("double_three_pieces", 1, 4, 3, 40, 5, 1, 2, 0, 1, 1, 1, 0, 0, [2, 7, 11], None),
        ("float_one_token_pieces", 0, 2, 2, 6, 0, 1, 0, 0, 1, 0, 1, 0, 0, [4, 1, 1, 1, 1], None),
        ("double_into_keep_states", 1, 5, 4, 33, 1, 1, 3, 1, 1, 1, 1, 1, 0, [1, 20], None),
        ("float_chunk3_state", 0, 8, 8, 48, 3, 1, 2, 0, 1, 1, 1, 1, 0, [2, 10, 30], None),
        ("double_unnormalised", 1, 3, 2, 20, 2, 0, 0, 0, 1, 1, 1, 0, 0, [1, 9], None),
        ("raw_gates_refused", 1, 3, 3, 12, 0, 1, 0, 0, 1, 1, 0, 0, 0, [1, 5], None),
        ("nan_in_v_checked", 0, 3, 2, 10, 0, 1, 0, 0, 1, 0, 1, 0, 0, [1, 4], nan_v),
        ("nan_in_v_unchecked", 1, 3, 2, 10, 0, 1, 0, 0, 0, 1, 1, 0, 0, [1, 4], nan_v),
        ("state_of_other_shape", 1, 3, 2, 10, 0, 1, 0, 0, 1, 1, 1, 0, 1, [0], None),
        ("chunk_zero", 0, 3, 2, 10, 0, 1, 0, 0, 1, 0, 1, 0, 2, [0], None),
        ("g_of_other_length", 1, 3, 2, 10, 0, 1, 0, 0, 1, 0, 1, 0, 3, [0], None),
        ("record_other_q", 1, 3, 2, 20, 4, 1, 2, 0, 1, 1, 1, 0, 4, [1, 8], None),
        ("grad_state_other_state", 1, 3, 2, 20, 4, 1, 2, 0, 1, 1, 1, 0, 5, [1, 8], None),
        ("grad_state_without_state", 0, 3, 2, 20, 4, 1, 2, 0, 1, 1, 1, 1, 6, [1, 8], None),
    ]:
        b = [t, dk - 1, dv - 1, n, chunk, 0, norm, eps, keep, cf, state, gates, into, mismatch]
        b += mat(61) + mat(62) + (v if v else mat(63)) + mat(64) + mat(65)
        if state:
            b += mat(66)
        b += mat(67) + cuts
        write("fuzz_delta", name, b)


def ssd():
    """fuzz_ssd: [double, d_head - 1, d_state - 1, n, chunk, dt_bias, softplus, keep_states,
    check_finite, state, raw, into, mismatch, A, D], x, dt, B, C, (h0), dout, the cut."""
    nan_x = [1 << 3, 7, 0, 0, 2, 1, 0]  # x with one NaN
    for name, t, p, s, n, chunk, bias, sp, keep, cf, state, raw, into, mismatch, a, d, cuts, x in [
        ("double_three_pieces", 1, 4, 3, 40, 4, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, [2, 7, 11], None),
        ("float_one_token_pieces", 0, 2, 2, 6, 0, 2, 1, 0, 1, 0, 0, 0, 0, 1, 1, [4, 1, 1, 1, 1], None),
        ("double_into_keep_states", 1, 5, 4, 33, 1, 1, 1, 1, 1, 1, 0, 1, 0, 2, 2, [1, 20], None),
        ("float_chunk3_state", 0, 8, 8, 48, 3, 0, 1, 0, 1, 1, 0, 1, 0, 4, 3, [2, 10, 30], None),
        ("double_without_softplus", 1, 3, 2, 20, 2, 3, 0, 0, 1, 1, 0, 0, 0, 3, 0, [1, 9], None),
        ("positive_A_refused", 1, 3, 3, 12, 0, 0, 1, 0, 1, 1, 1, 0, 0, 12, 12, [1, 5], None),
        ("nan_in_x_checked", 0, 3, 2, 10, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, [1, 4], nan_x),
        ("nan_in_x_unchecked", 1, 3, 2, 10, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, [1, 4], nan_x),
        ("state_of_other_shape", 1, 3, 2, 10, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0, 0, [0], None),
        ("chunk_zero", 0, 3, 2, 10, 0, 0, 1, 0, 1, 0, 0, 0, 2, 0, 0, [0], None),
        ("dt_of_other_length", 1, 3, 2, 10, 0, 0, 1, 0, 1, 0, 0, 0, 3, 0, 0, [0], None),
        ("record_other_x", 1, 3, 2, 20, 4, 0, 1, 0, 1, 1, 0, 0, 4, 0, 0, [1, 8], None),
        ("grad_state_other_state", 1, 3, 2, 20, 4, 0, 1, 0, 1, 1, 0, 0, 5, 0, 0, [1, 8], None),
        ("grad_state_without_state", 0, 3, 2, 20, 4, 0, 1, 0, 1, 1, 0, 1, 6, 0, 0, [1, 8], None),
    ]:
        b = [t, p - 1, s - 1, n, chunk, bias, sp, keep, cf, state, 8 if raw else 1, into, mismatch,
             a, d]
        b += (x if x else mat(71)) + mat(72) + mat(73) + mat(74)
        if state:
            b += mat(75)
        b += mat(76) + cuts
        write("fuzz_ssd", name, b)
def linformer():
    """fuzz_linformer: [double, d - 1, d_v - 1, n, k_proj - 1, scale, causal, check_finite, into,
    mismatch], q, k, v, E, F, dout."""
    nan_v = [1 << 3, 7, 0, 0, 2, 1, 0]  # v with one NaN
    for name, t, d, dv, n, kp, scale, causal, cf, into, mismatch, v in [
        ("double_moderate", 1, 4, 3, 40, 6, 0, 0, 1, 0, 0, None),
        ("float_into", 0, 8, 8, 48, 8, 2, 0, 1, 1, 0, None),
        ("double_one_row_kproj1", 1, 3, 2, 1, 1, 3, 0, 1, 0, 0, None),
        ("double_empty", 1, 3, 2, 0, 4, 0, 0, 1, 1, 0, None),
        ("causal_refused", 1, 3, 2, 10, 2, 0, 7, 1, 0, 0, None),
        ("nan_in_v_checked", 0, 3, 2, 10, 3, 0, 0, 1, 0, 0, nan_v),
        ("nan_in_v_unchecked", 1, 3, 2, 10, 3, 0, 0, 0, 0, 0, nan_v),
        ("E_of_other_length", 1, 3, 2, 12, 3, 0, 0, 1, 0, 1, None),
        ("F_of_other_kproj", 0, 3, 2, 12, 3, 0, 0, 1, 0, 2, None),
        ("record_other_q", 1, 3, 2, 20, 4, 0, 0, 1, 0, 3, None),
        ("record_other_E", 0, 3, 2, 20, 4, 0, 0, 1, 1, 4, None),
    ]:
        b = [t, d - 1, dv - 1, n, kp - 1, scale, causal, cf, into, mismatch]
        b += mat(71) + mat(72) + (v if v else mat(73)) + mat(74) + mat(75) + mat(76)
        write("fuzz_linformer", name, b)


if __name__ == "__main__":
    gma_state()
    into()
    packed()
    baselines()
    layer_load()
    layer_decode()
    delta()
    ssd()
    linformer()
