//! Reading and writing 2-D float32 `.npy` files (through the `npyz` crate).

use crate::error::{Error, Result};
use npyz::WriterBuilder;
use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
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

/// Writes a row-major matrix as a C-order float32 `.npy`, atomically: the data goes to a
/// temporary file beside `path`, which is renamed over it only once complete.
pub fn write_matrix(path: &Path, m: &Matrix) -> Result<()> {
    let tmp = path.with_extension("npy.partial");
    let result = (|| -> std::io::Result<()> {
        let mut out = BufWriter::new(File::create(&tmp)?);
        {
            let mut writer = npyz::WriteOptions::<f32>::new()
                .default_dtype()
                .shape(&[m.rows as u64, m.cols as u64])
                .writer(&mut out)
                .begin_nd()?;
            writer.extend(m.data.iter().copied())?;
            writer.finish()?;
        }
        out.flush()?;
        out.get_ref().sync_all()?;
        Ok(())
    })();
    match result.and_then(|_| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(Error::file(path, e))
        }
    }
}
