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
    let text = String::from_utf8_lossy(&header).into_owned();
    bytes.extend(header);
    if !(text.contains("'<f4'") || text.contains("'float32'")) {
        return Err(Error::file(&path, "expected dtype float32 ('<f4')"));
    }
    let data = claimed_dims(&text)
        .and_then(|dims| dims.iter().try_fold(4u128, |acc, &d| acc.checked_mul(d)))
        .filter(|&b| b <= 4 * crate::algorithm::MAX_OPERAND_ELEMENTS as u128)
        .ok_or_else(|| {
            bad(format!(
                "the header's shape is not one of at most {} float32 values",
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
    check_claimed_shape(path, &mut source, file_bytes)?;
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

/// Refuses a header whose shape holds more values than the file has bytes, before the
/// `npyz` parser multiplies the dimensions (which overflows on a forged header). A header this
/// cannot read is left to `npyz`, whose error says what is wrong.
pub(crate) fn check_claimed_shape(
    path: &Path,
    file: &mut (impl Read + Seek),
    file_bytes: Option<u64>,
) -> Result<()> {
    let mut head = Vec::with_capacity(4096);
    let n = file
        .by_ref()
        .take(4096)
        .read_to_end(&mut head)
        .map_err(|e| Error::file(path, e))?;
    file.rewind().map_err(|e| Error::file(path, e))?;
    let text = String::from_utf8_lossy(&head[..n]);
    let (Some(dims), Some(len)) = (claimed_dims(&text), file_bytes) else {
        return Ok(());
    };
    let bytes = dims.iter().try_fold(1u128, |acc, &d| acc.checked_mul(d));
    // The parser multiplies the dimensions in u64 in order, so a zero at the end does not save
    // a product of the others that overflows (a fuzzed header found it: (16, 2^60, 0)).
    let nonzero = dims
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1u128, |acc, &d| acc.checked_mul(d));
    let parsable = nonzero.is_some_and(|p| p.saturating_mul(8) <= u64::MAX as u128);
    if !parsable || bytes.is_none_or(|b| b > len as u128) {
        let shape: Vec<String> = dims.iter().map(u128::to_string).collect();
        return Err(Error::file(
            path,
            format!(
                "the header claims a {} array, more than the file's {len} bytes hold",
                shape.join("x")
            ),
        ));
    }
    Ok(())
}

/// The dimensions of the `'shape'` of a .npy header, where they can be read.
fn claimed_dims(text: &str) -> Option<Vec<u128>> {
    let at = text.find("'shape'")?;
    let open = at + text[at..].find('(')?;
    let close = open + text[open..].find(')')?;
    text[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<u128>().ok())
        .collect()
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
