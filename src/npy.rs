//! Reading and writing 2-D float32 `.npy` files (through the `npyz` crate).

use crate::error::{Error, Result};
use npyz::WriterBuilder;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

/// A row-major f32 matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Matrix> {
        if data.len() != rows * cols {
            return Err(Error::LengthMismatch {
                what: "matrix data",
                expected: rows * cols,
                got: data.len(),
            });
        }
        Ok(Matrix { rows, cols, data })
    }
}

/// Reads a 2-D float32 array (C or Fortran order) into a row-major matrix.
pub fn read_matrix(path: &Path) -> Result<Matrix> {
    let file = File::open(path).map_err(|e| Error::file(path, e))?;
    let npy = npyz::NpyFile::new(BufReader::new(file))
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
    let mut values = Vec::with_capacity(rows * cols);
    for v in reader {
        values
            .push(v.map_err(|e| Error::file(path, format!("truncated or unreadable data: {e}")))?);
    }
    if values.len() != rows * cols {
        return Err(Error::file(
            path,
            format!("truncated: {} of {} values", values.len(), rows * cols),
        ));
    }
    let data = match order {
        npyz::Order::C => values,
        npyz::Order::Fortran => {
            let mut data = vec![0f32; rows * cols];
            for (e, v) in values.into_iter().enumerate() {
                let (i, j) = (e % rows, e / rows);
                data[i * cols + j] = v;
            }
            data
        }
    };
    Matrix::new(rows, cols, data)
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
            .map_err(|e| Error::file(path, e))?;
        writer
            .extend(m.data.iter().copied())
            .map_err(|e| Error::file(path, e))?;
        writer.finish().map_err(|e| Error::file(path, e))
    })
}
