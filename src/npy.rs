//! Reading and writing 2-D float32 `.npy` files (through the `npyz` crate).

use crate::error::{Error, Result};
use crate::input::Input;
use npyz::WriterBuilder;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

/// A row-major f32 matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// rows x cols values, row-major.
    pub data: Vec<f32>,
}

impl Matrix {
    /// A matrix of `data`, refused where its length is not rows x cols.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Matrix> {
        let expected = rows.checked_mul(cols).ok_or_else(|| {
            Error::invalid(
                "matrix",
                format!("{rows}x{cols} overflows the address space"),
            )
        })?;
        if data.len() != expected {
            return Err(Error::LengthMismatch {
                what: "matrix data",
                expected,
                got: data.len(),
            });
        }
        Ok(Matrix { rows, cols, data })
    }
}

/// Reads a 2-D float32 array (C or Fortran order) into a row-major matrix, from a regular file
/// or from standard input (`-`), opened by `input::Input` (a FIFO or device is refused). The
/// shape in the header is checked against the file's length, with overflow-checked arithmetic,
/// before anything is allocated; from standard input the header is read first and the data it
/// declares then read exactly.
pub fn read_matrix(path: &Path) -> Result<Matrix> {
    read_matrix_input(Input::open(path)?)
}

/// `read_matrix` over an opened input: a file is read with its length known, a stream header
/// first.
pub fn read_matrix_input(input: Input) -> Result<Matrix> {
    let path = input.path().to_path_buf();
    match input.into_file() {
        Ok((file, len)) => read_matrix_from(BufReader::new(file), Some(len), &path),
        Err(stream) => read_matrix_stream(stream),
    }
}

/// The longest .npy header read from a stream: numpy writes a few hundred bytes.
const MAX_STREAM_HEADER: u64 = 1 << 20;

/// `read_matrix` over a stream of unknown length: the preamble and header first, then exactly
/// the bytes the header declares (asked of the host first), then nothing more.
fn read_matrix_stream(mut input: Input) -> Result<Matrix> {
    let path = input.path().to_path_buf();
    let bad = |why: String| Error::file(&path, format!("not a valid .npy file: {why}"));
    let mut bytes = input.read_exactly(8, "the .npy preamble")?;
    if &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("no .npy magic".into()));
    }
    let width = match bytes[6] {
        1 => 2,
        2 | 3 => 4,
        v => return Err(bad(format!("version {v}"))),
    };
    bytes.extend(input.read_exactly(width, "the .npy header length")?);
    let header_len = if width == 2 {
        u16::from_le_bytes([bytes[8], bytes[9]]) as u64
    } else {
        u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as u64
    };
    if header_len > MAX_STREAM_HEADER {
        return Err(bad(format!("a header of {header_len} bytes")));
    }
    let header = input.read_exactly(header_len, "the .npy header")?;
    let head = parse_header(&header).map_err(bad)?;
    bytes.extend(header);
    if !matches!(&head.descr, py_literal::Value::String(d) if d == "<f4") {
        return Err(Error::file(&path, "expected dtype float32 ('<f4')"));
    }
    let data = head
        .values()
        .and_then(|n| n.checked_mul(4))
        .filter(|&b| b <= 4 * crate::algorithm::MAX_OPERAND_ELEMENTS as u64)
        .ok_or_else(|| {
            bad(format!(
                "the header's shape {:?} is not one of at most {} float32 values",
                head.shape,
                crate::algorithm::MAX_OPERAND_ELEMENTS
            ))
        })?;
    bytes.extend(input.read_exactly(data as u64, "the .npy data")?);
    input.expect_end("the data its header declares")?;
    let len = bytes.len() as u64;
    read_matrix_from(std::io::Cursor::new(bytes), Some(len), &path)
}

/// `read_matrix` over any seekable source of `len` bytes (when known); `path` names it in errors.
pub fn read_matrix_from(
    mut source: impl Read + Seek,
    file_bytes: Option<u64>,
    path: &Path,
) -> Result<Matrix> {
    let data_start = check_claimed_shape(path, &mut source, file_bytes)?;
    let npy = npyz::NpyFile::new(source)
        .map_err(|e| Error::file(path, format!("not a valid .npy file: {e}")))?;
    let shape = npy.shape().to_vec();
    let order = npy.order();
    let dtype = npy.dtype().descr();
    let [rows, cols] = shape[..] else {
        return Err(Error::file(
            path,
            format!(
                "expected a 2-D array, found {} dimension(s) {shape:?}",
                shape.len()
            ),
        ));
    };
    let (rows, cols) = (rows as usize, cols as usize);
    let reader = npy.data::<f32>().map_err(|_| {
        Error::file(
            path,
            format!("expected dtype float32 ('<f4'), found {dtype}"),
        )
    })?;
    // The data must fit in the file: a header claiming more is refused before any allocation.
    let fits = |n: usize| {
        let bytes = (n as u64).checked_mul(4);
        bytes.is_some_and(|b| file_bytes.is_none_or(|len| b <= len))
    };
    let count = match rows.checked_mul(cols) {
        Some(n) if fits(n) => n,
        _ => {
            return Err(Error::file(
                path,
                format!(
                    "the header claims {rows}x{cols} float32 values, more than the file's {} bytes hold",
                    file_bytes.map_or("unknown".into(), |b| b.to_string())
                ),
            ));
        }
    };
    let mut values = crate::memory::empty_with_capacity("the .npy values", count)?;
    for v in reader {
        values
            .push(v.map_err(|e| Error::file(path, format!("truncated or unreadable data: {e}")))?);
    }
    if values.len() != count {
        return Err(Error::file(
            path,
            format!("truncated: {} of {count} values", values.len()),
        ));
    }
    check_no_trailing(path, data_start, 4 * count as u64, file_bytes)?;
    let data = match order {
        npyz::Order::C => values,
        npyz::Order::Fortran => {
            let mut data = crate::memory::host_buffer::<f32>("the .npy values", count)?;
            for (e, v) in values.into_iter().enumerate() {
                let (i, j) = (e % rows, e / rows);
                data[i * cols + j] = v;
            }
            data
        }
    };
    Matrix::new(rows, cols, data)
}

/// What a .npy header says, read as `npyz` reads it: the same parser (`py_literal`), the
/// same keys; a key named twice, which `npyz` would take the last of, is refused.
pub(crate) struct Header {
    /// The dtype's description (a string such as '<f4', or a record's list).
    pub descr: py_literal::Value,
    /// The dimensions.
    pub shape: Vec<u64>,
    /// Bytes before the data: the preamble, the header's length and the header.
    pub data_start: u64,
}

impl Header {
    /// The number of values the shape holds, None where it overflows 64 bits.
    pub fn values(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
    }
}

/// The header text `bytes` (after the preamble and length) read as `npyz` reads it, or why it
/// cannot be.
pub(crate) fn parse_header(bytes: &[u8]) -> std::result::Result<Header, String> {
    use py_literal::Value;
    let text = match bytes.split_last() {
        Some((b'\n', rest)) => rest,
        _ => bytes,
    };
    let text = std::str::from_utf8(text).map_err(|_| "the header is not UTF-8".to_string())?;
    let value: Value = text
        .parse()
        .map_err(|e| format!("the header is not a Python literal ({e})"))?;
    let Value::Dict(entries) = value else {
        return Err("the header is not a dict".into());
    };
    let mut seen: Vec<&str> = Vec::new();
    for (key, _) in &entries {
        let Value::String(key) = key else {
            return Err("a key of the header is not a string".into());
        };
        if seen.contains(&key.as_str()) {
            return Err(format!("the header names '{key}' twice"));
        }
        seen.push(key);
    }
    let get = |name: &str| {
        (entries.iter())
            .find(|(k, _)| matches!(k, Value::String(k) if k == name))
            .map(|(_, v)| v)
            .ok_or_else(|| format!("the header has no {name:?}"))
    };
    let shape = match get("shape")? {
        Value::Tuple(dims) | Value::List(dims) => {
            dims.iter()
                .map(|d| match d {
                    Value::Integer(n) => n.to_string().parse::<u64>().map_err(|_| {
                        format!("the header's dimension {n} is not one of 0 to 2^64-1")
                    }),
                    other => Err(format!("the header's dimension {other} is not an integer")),
                })
                .collect::<std::result::Result<Vec<u64>, String>>()?
        }
        other => return Err(format!("the header's shape {other} is not a tuple")),
    };
    Ok(Header {
        descr: get("descr")?.clone(),
        shape,
        data_start: 0,
    })
}

/// The .npy header at the start of `file`, read with `parse_header` (the file rewound after):
/// None where there is no .npy preamble or the header is longer than the file.
fn read_header(
    file: &mut (impl Read + Seek),
    file_bytes: Option<u64>,
) -> std::io::Result<Option<std::result::Result<Header, String>>> {
    let mut pre = Vec::with_capacity(12);
    file.by_ref().take(12).read_to_end(&mut pre)?;
    let header = match pre.get(..8) {
        Some(magic) if &magic[..6] == b"\x93NUMPY" => {
            let (at, len) = match (magic[6], pre.len()) {
                (1, 10..) => (10, u16::from_le_bytes([pre[8], pre[9]]) as u64),
                (2 | 3, 12..) => (
                    12,
                    u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]) as u64,
                ),
                _ => (0, 0),
            };
            let fits = file_bytes.is_none_or(|n| at + len <= n) && len <= MAX_STREAM_HEADER;
            match at > 0 && fits {
                true => {
                    file.seek(std::io::SeekFrom::Start(at))?;
                    let mut text = Vec::with_capacity(len as usize);
                    file.by_ref().take(len).read_to_end(&mut text)?;
                    Some(parse_header(&text).map(|h| Header {
                        data_start: at + len,
                        ..h
                    }))
                }
                false => None,
            }
        }
        _ => None,
    };
    file.rewind()?;
    Ok(header)
}

/// Refuses a header whose shape holds more values than the file has bytes (each at least one),
/// or whose sizes overflow where `npyz` multiplies them, before the `npyz` parser reads it: the
/// header read by the parser `npyz` uses (`parse_header`), so that both see one shape. A header
/// that parser refuses is refused here with its reason; a file with no .npy preamble is left
/// to `npyz`, whose error says what is wrong. Returns the bytes before the data, where read.
pub(crate) fn check_claimed_shape(
    path: &Path,
    file: &mut (impl Read + Seek),
    file_bytes: Option<u64>,
) -> Result<Option<u64>> {
    let header = read_header(file, file_bytes).map_err(|e| Error::file(path, e))?;
    let header = match header {
        None => return Ok(None),
        Some(Err(why)) => {
            return Err(Error::file(path, format!("not a valid .npy file: {why}")));
        }
        Some(Ok(h)) => h,
    };
    let dims = &header.shape;
    // The parser multiplies the dimensions in u64 in order (and its strides the ones after
    // each), so a zero at the end does not save a product of the others that overflows (a
    // fuzzed header found it: (16, 2^60, 0)).
    let nonzero = (dims.iter())
        .filter(|&&d| d != 0)
        .try_fold(1u64, |acc, &d| acc.checked_mul(d));
    let parsable = nonzero.is_some_and(|p| p.checked_mul(8).is_some());
    let bytes = header.values();
    if !parsable || bytes.is_none_or(|b| file_bytes.is_some_and(|len| b > len)) {
        let shape: Vec<String> = dims.iter().map(u64::to_string).collect();
        return Err(Error::file(
            path,
            format!(
                "the header claims a {} array, more than the file's {} bytes hold",
                shape.join("x"),
                file_bytes.map_or("unknown".into(), |b| b.to_string())
            ),
        ));
    }
    Ok(Some(header.data_start))
}

/// Refuses a file that holds more than its header declares (`data_start` and `data` bytes
/// after it): bytes a reader would leave unread, as a stream's reader refuses them.
pub(crate) fn check_no_trailing(
    path: &Path,
    data_start: Option<u64>,
    data: u64,
    file_bytes: Option<u64>,
) -> Result<()> {
    if let (Some(start), Some(len)) = (data_start, file_bytes)
        && let Some(extra) = len
            .checked_sub(start.saturating_add(data))
            .filter(|&e| e > 0)
    {
        return Err(Error::file(
            path,
            format!(
                "{extra} {} the data its header declares ({len} in all)",
                if extra == 1 {
                    "byte follows"
                } else {
                    "bytes follow"
                }
            ),
        ));
    }
    Ok(())
}

/// Writes a row-major matrix as a C-order float32 `.npy` through `output::write_file` (whole
/// or not at all; a device such as /dev/stdout written in place).
pub fn write_matrix(path: &Path, m: &Matrix) -> Result<()> {
    crate::output::write_file(path, |out| {
        let mut writer = npyz::WriteOptions::<f32>::new()
            .default_dtype()
            .shape(&[m.rows as u64, m.cols as u64])
            .writer(out)
            .begin_nd()
            .map_err(|e| Error::output(path, e))?;
        writer
            .extend(m.data.iter().copied())
            .map_err(|e| Error::output(path, e))?;
        writer.finish().map_err(|e| Error::output(path, e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// Bytes after the data a header declares are refused, by a file's reader as by a
    /// stream's, the matrix's and the batches' alike (a file's were left unread in silence).
    #[test]
    fn bytes_after_the_declared_data_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.npy");
        write_matrix(&path, &Matrix::new(2, 3, vec![1.0; 6]).unwrap()).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        let read =
            |b: &[u8]| read_matrix_from(Cursor::new(b.to_vec()), Some(b.len() as u64), &path);
        assert!(read(&bytes).is_ok());
        bytes.extend([0u8; 3]);
        let e = read(&bytes).unwrap_err();
        assert!(e.to_string().contains("3 bytes follow the data"), "{e}");

        // Batches of u8 ids [1, 1, 3]: three bytes of data, then one more.
        let mut header =
            "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 1, 3), }".to_string();
        while !(10 + header.len() + 1).is_multiple_of(64) {
            header.push(' ');
        }
        header.push('\n');
        let mut batches = b"\x93NUMPY\x01\x00".to_vec();
        batches.extend((header.len() as u16).to_le_bytes());
        batches.extend(header.as_bytes());
        batches.extend([1u8, 2, 3]);
        let load = |b: &[u8]| {
            let len = Some(b.len() as u64);
            crate::train::Batches::read(&mut Cursor::new(b.to_vec()), len, &path, (1, 2, 5, 1))
        };
        assert!(load(&batches).is_ok());
        batches.push(4);
        let e = load(&batches).unwrap_err();
        assert!(e.to_string().contains("1 byte follows the data"), "{e}");
    }
}
