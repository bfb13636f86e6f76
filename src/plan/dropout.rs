//! Dropout's masks from a counter-based generator, the same bits on every backend: element e
//! of dropout site `site` at step t is kept where the first word of Philox4x32-10 (Salmon et
//! al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123's constants) of
//! the counter (e, t, site, 0) under the key (the seed's low and high words), as a uniform
//! (its top 24 bits times 2^-24), is at least p. e counts over the global batch: a run of
//! part k of a step split into equal parts (ranks, micro-batches: scalar `PART`) numbers its
//! n elements from k n (wrapping at 2^32), so that the split step draws the unsplit step's masks. `shaders/train.wgsl` (`philox`, `dropout`)
//! and `cuda/train.cu` compute the same words; tests/conformance.rs and tests/cuda.rs compare
//! their outputs with these to the bit. PyTorch's masks come from another generator (and
//! differ by device): no run of PyTorch reproduces these, and none of ours differs.

/// Philox's round multipliers and Weyl key increments (Random123).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// The four words of Philox4x32-10 of `counter` under `key`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// The key of a model's masks: its seed's two words.
pub fn key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// A uniform value in [0, 1) from a word: its top 24 bits times 2^-24 (exact in f32).
pub fn uniform(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Whether element `e` of site `site` is kept at step `step`.
pub fn keeps(e: u32, step: u32, site: u32, key: [u32; 2], p: f32) -> bool {
    uniform(philox4x32_10([e, step, site, 0], key)[0]) >= p
}

/// The factor on the kept values: 1 / (1 - p), computed in f64 and rounded to f32.
pub fn keep_scale(p: f32) -> f32 {
    (1.0 / (1.0 - f64::from(p))) as f32
}

/// out[e] = x[e] * (kept ? scale : 0) in f32 (a NaN or an infinity dropped stays NaN, as
/// PyTorch's x * mask * scale), x being part `part` of the global batch: the forward and,
/// applied to dy, the backward.
pub fn apply(x: &[f32], (step, site, part): (u32, u32, u32), key: [u32; 2], p: f32) -> Vec<f32> {
    let scale = keep_scale(p);
    let first = part.wrapping_mul(x.len() as u32);
    x.iter()
        .enumerate()
        .map(|(e, &v)| {
            v * if keeps(first.wrapping_add(e as u32), step, site, key, p) {
                scale
            } else {
                0.0
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for Philox4x32-10 (kat_vectors).
    #[test]
    fn philox_gives_random123_s_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn masks_keep_about_one_minus_p_and_change_with_step_site_and_seed() {
        let (n, p) = (100_000u32, 0.3);
        let kept = |step: u32, site: u32, seed: u64| {
            (0..n).filter(move |&e| keeps(e, step, site, key(seed), p))
        };
        let count = kept(1, 0, 7).count() as f64 / n as f64;
        assert!((count - 0.7).abs() < 0.01, "{count}");
        let first: Vec<u32> = kept(1, 0, 7).take(50).collect();
        for other in [kept(2, 0, 7), kept(1, 1, 7), kept(1, 0, 8)] {
            assert_ne!(first, other.take(50).collect::<Vec<_>>());
        }
        assert_eq!(keep_scale(0.5), 2.0);
        assert!(!keeps(0, 1, 0, key(7), 1.0) && keeps(0, 1, 0, key(7), 0.0));
    }

    #[test]
    fn the_parts_of_a_split_batch_draw_the_whole_batch_s_mask() {
        let x: Vec<f32> = (0..96).map(|i| i as f32 + 1.0).collect();
        let whole = apply(&x, (3, 1, 0), key(5), 0.5);
        let parts: Vec<f32> = (x.chunks(32).enumerate())
            .flat_map(|(k, part)| apply(part, (3, 1, k as u32), key(5), 0.5))
            .collect();
        assert_eq!(whole, parts);
        assert_ne!(apply(&x[..32], (3, 1, 1), key(5), 0.5), whole[..32]);
    }
}
