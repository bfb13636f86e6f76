//! GPT-2's byte-level BPE (`--config gpt2`), through tiktoken-rs's `r50k_base`, whose encoder
//! ships in the crate (nothing is downloaded), and the cache of a corpus's tokens: a corpus is
//! tokenized once, and a cache file that does not hold this very text's tokens is rebuilt,
//! never trusted.

#[cfg(target_arch = "wasm32")]
use crate::error::Error;
use crate::error::Result;

/// Tokens of GPT-2's vocabulary (`Vocab::Gpt2`).
pub const GPT2_TOKENS: usize = 50257;

/// GPT-2's tokens of `text` (special tokens such as `<|endoftext|>` read as plain text).
pub fn gpt2_encode(text: &str) -> Result<Vec<u32>> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        Ok(tiktoken_rs::r50k_base_singleton().encode_ordinary(text))
    }
    #[cfg(target_arch = "wasm32")]
    {
        let _ = text;
        Err(Error::invalid(
            "tokenizer",
            "GPT-2's BPE is not in the browser build",
        ))
    }
}

/// The bytes of GPT-2's tokens `ids` ("?" for an id outside the vocabulary).
pub fn gpt2_decode(ids: &[u32]) -> Vec<u8> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let bpe = tiktoken_rs::r50k_base_singleton();
        ids.iter()
            .flat_map(|&id| bpe.decode_bytes(&[id]).unwrap_or_else(|_| b"?".to_vec()))
            .collect()
    }
    #[cfg(target_arch = "wasm32")]
    {
        ids.iter().map(|_| b'?').collect()
    }
}

/// The cache file's first bytes (format 1).
const MAGIC: &[u8; 8] = b"MNTOK1\n\0";

/// Bytes before the ids: the magic, the text's length (u64) and CRC-32 (u32), the ids' count
/// (u64) and the CRC-32 of their bytes (u32), little-endian.
const HEADER: usize = 8 + 8 + 4 + 8 + 4;

/// GPT-2's tokens of `text`, from the cache where it holds them (the cache directory's
/// `tokens/gpt2-LEN-CRC.bin`, ids as u16: GPT-2 has fewer than 65536), else encoded and the
/// cache written. A cache file is used only where its header names this text (length and
/// CRC-32), its length is its count's, the CRC-32 of its ids holds and every id is one of
/// GPT-2's; else it is rebuilt, said once on standard error.
pub fn gpt2_cached(text: &str) -> Result<Vec<u32>> {
    let key = (text.len() as u64, crc32fast::hash(text.as_bytes()));
    let Some(dir) = crate::cache::dir() else {
        return gpt2_encode(text);
    };
    let path = dir
        .join("tokens")
        .join(format!("gpt2-{:x}-{:08x}.bin", key.0, key.1));
    // Two bytes a token, and a token holds at least one byte of text.
    let limit = HEADER as u64 + 2 * key.0;
    if let Some(bytes) = crate::cache::read_within(&path, limit) {
        match from_cache(&bytes, key) {
            Ok(ids) => return Ok(ids),
            Err(why) => eprintln!(
                "mantissa: warning: token cache {} rebuilt: {why}",
                path.display()
            ),
        }
    }
    let ids = gpt2_encode(text)?;
    if let Err(e) = crate::cache::write_atomic(&path, &to_cache(&ids, key)) {
        eprintln!("mantissa: warning: token cache not written: {e}");
    }
    Ok(ids)
}

/// The cache file of `ids`, the tokens of a text of (length, CRC-32) `key`.
fn to_cache(ids: &[u32], key: (u64, u32)) -> Vec<u8> {
    let body: Vec<u8> = ids
        .iter()
        .flat_map(|&id| (id as u16).to_le_bytes())
        .collect();
    let mut bytes = Vec::with_capacity(HEADER + body.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&key.0.to_le_bytes());
    bytes.extend_from_slice(&key.1.to_le_bytes());
    bytes.extend_from_slice(&(ids.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    bytes.extend_from_slice(&body);
    bytes
}

/// The ids a cache file holds, if it holds the tokens of the text of `key` intact; else why not.
fn from_cache(bytes: &[u8], key: (u64, u32)) -> std::result::Result<Vec<u32>, String> {
    let field = |at: usize, n: usize| bytes.get(at..at + n).ok_or("shorter than its header");
    let u64_at = |at| field(at, 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
    let u32_at = |at| field(at, 4).map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])));
    if field(0, 8)? != MAGIC {
        return Err("not a token cache of this format".into());
    }
    if (u64_at(8)?, u32_at(16)?) != key {
        return Err("it holds the tokens of another text".into());
    }
    let (count, crc) = (u64_at(20)?, u32_at(28)?);
    let body = &bytes[HEADER..];
    if Some(body.len() as u64) != count.checked_mul(2) {
        return Err(format!("{} bytes of ids for {count} tokens", body.len()));
    }
    if crc32fast::hash(body) != crc {
        return Err("its ids fail their CRC-32".into());
    }
    let ids: Vec<u32> = (body.chunks_exact(2))
        .map(|p| u32::from(u16::from_le_bytes([p[0], p[1]])))
        .collect();
    match ids.iter().position(|&id| id as usize >= GPT2_TOKENS) {
        Some(i) => Err(format!("id {} at {i} is not one of GPT-2's", ids[i])),
        None => Ok(ids),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's ids of a known text (as `tiktoken.get_encoding("gpt2")` gives them), and back.
    #[test]
    fn gpt2_tokens_are_gpt2_s() {
        let ids = gpt2_encode("Hello world").unwrap();
        assert_eq!(ids, [15496, 995]);
        assert_eq!(gpt2_decode(&ids), b"Hello world");
        // A character split over tokens decodes whole once its bytes are together.
        let ids = gpt2_encode("é€").unwrap();
        assert_eq!(String::from_utf8(gpt2_decode(&ids)).unwrap(), "é€");
    }

    /// A cache holds its text's tokens; a cache of another text, a corrupt one, a truncated
    /// one or one with an id outside GPT-2's is refused, saying why.
    #[test]
    fn a_token_cache_is_used_only_when_intact_and_of_this_text() {
        let text = "To be, or not to be, that is the question.";
        let key = (text.len() as u64, crc32fast::hash(text.as_bytes()));
        let ids = gpt2_encode(text).unwrap();
        let good = to_cache(&ids, key);
        assert_eq!(from_cache(&good, key).unwrap(), ids);
        let other = (key.0, key.1 ^ 1);
        assert!(
            from_cache(&good, other)
                .unwrap_err()
                .contains("another text")
        );
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(from_cache(&flipped, key).unwrap_err().contains("CRC-32"));
        assert!(
            from_cache(&good[..good.len() - 1], key)
                .unwrap_err()
                .contains("bytes of ids")
        );
        assert!(from_cache(&good[..10], key).unwrap_err().contains("header"));
        let outside = to_cache(&[60000], key);
        assert!(
            from_cache(&outside, key)
                .unwrap_err()
                .contains("not one of GPT-2's")
        );
        assert!(from_cache(b"garbage!garbage!", key).is_err());
    }
}
