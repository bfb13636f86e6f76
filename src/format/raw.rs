//! Raw binary conversion between formats: streams of little-endian codes.

use super::{Format, Overflow};
use crate::error::{Error, Result};
use std::io::{Read, Write};

/// Converts raw little-endian codes of `from` read from `reader` into codes of `to` written to
/// `writer`, element by element as `Format::decode` and `Format::encode` do (`mantissa cast
/// --raw`). Works in 64 KiB chunks: constant memory whatever the input size, and any split of
/// the input into reads gives the same bytes. Returns the bytes read; input that is not a whole
/// number of elements is an error (after the whole elements were written).
pub fn convert_raw(
    reader: &mut dyn Read,
    writer: &mut dyn Write,
    from: Format,
    to: Format,
    overflow: Overflow,
) -> Result<u64> {
    let (in_size, out_size) = (from.storage_bytes(), to.storage_bytes());
    let mut buf = vec![0u8; 64 * 1024];
    let mut carry = 0usize;
    let mut total = 0u64;
    let mut out = Vec::with_capacity(buf.len() / in_size * out_size);
    loop {
        let n = match reader.read(&mut buf[carry..]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            break;
        }
        total += n as u64;
        let have = carry + n;
        let whole = have / in_size * in_size;
        out.clear();
        for chunk in buf[..whole].chunks_exact(in_size) {
            let mut word = [0u8; 4];
            word[..in_size].copy_from_slice(chunk);
            let x = from.decode(u32::from_le_bytes(word));
            out.extend_from_slice(&to.encode(x, overflow).to_le_bytes()[..out_size]);
        }
        writer.write_all(&out)?;
        buf.copy_within(whole..have, 0);
        carry = have - whole;
    }
    if carry != 0 {
        return Err(Error::invalid(
            "raw input",
            format!(
                "{total} bytes is not a multiple of the element size {in_size} ({carry} bytes left over)"
            ),
        ));
    }
    Ok(total)
}
