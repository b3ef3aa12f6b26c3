//! .npy in (float32 or float16, C order) and out (float32), through the npyz crate.

use sdpa::{Error, Result};
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::Path;

fn io_err(path: &Path, msg: impl ToString) -> Error {
    Error::Io {
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}

/// Reads an array as f32, with its shape.
pub fn read(path: &Path) -> Result<(Vec<f32>, Vec<usize>)> {
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    let npy = npyz::NpyFile::new(BufReader::new(file))
        .map_err(|e| io_err(path, format!("not a .npy file: {e}")))?;
    if npy.order() != npyz::Order::C {
        return Err(io_err(
            path,
            "Fortran-order arrays are not supported; save with C order",
        ));
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let descr = npy.dtype().descr();
    let data = match descr.trim_matches('\'') {
        "<f4" => npy.into_vec::<f32>(),
        "<f2" => npy
            .into_vec::<half::f16>()
            .map(|v| v.into_iter().map(f32::from).collect()),
        other => {
            return Err(io_err(
                path,
                format!("dtype {other} is not supported (float32 or float16 expected)"),
            ));
        }
    }
    .map_err(|e| io_err(path, format!("truncated or corrupt data: {e}")))?;
    Ok((data, shape))
}

/// Writes f32 data with the given shape.
pub fn write(path: &Path, data: &[f32], shape: &[usize]) -> Result<()> {
    use npyz::WriterBuilder;
    let file = File::create(path).map_err(|e| io_err(path, e))?;
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&shape)
        .writer(BufWriter::new(file))
        .begin_nd()
        .map_err(|e| io_err(path, e))?;
    w.extend(data.iter().copied())
        .map_err(|e| io_err(path, e))?;
    w.finish().map_err(|e| io_err(path, e))
}
