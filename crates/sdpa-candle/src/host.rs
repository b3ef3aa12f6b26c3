//! What the ops check and convert on the host: dtypes, shapes and strides of candle layouts, as
//! sdpa names them; CPU storage to and from the f64 the reference takes; metadata as sdpa's i32.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Error, Layout, Result, Shape, Tensor, bail};
use half::{bf16, f16};

/// The sdpa element type of a candle dtype: f16 and bf16 only.
pub(crate) fn sdpa_dtype(dtype: DType) -> Result<sdpa::DType> {
    match dtype {
        DType::F16 => Ok(sdpa::DType::F16),
        DType::BF16 => Ok(sdpa::DType::Bf16),
        other => bail!("sdpa-candle: {other:?} tensors are not supported (f16 or bf16)"),
    }
}

/// That Q, K and V share one dtype.
pub(crate) fn same_dtype(q: DType, k: DType, v: DType) -> Result<()> {
    if q != k || q != v {
        bail!("sdpa-candle: q, k and v are {q:?}, {k:?} and {v:?}; they must match");
    }
    Ok(())
}

/// V's head dim: its last dimension, where its other dimensions are K's (V may be narrower or
/// wider than Q and K, as DeepSeek's 192 / 128).
pub(crate) fn v_head_dim(k: &Layout, v: &Layout) -> Result<usize> {
    let (kd, vd) = (k.shape().dims(), v.shape().dims());
    match (kd.split_last(), vd.split_last()) {
        (Some((_, rows_k)), Some((&dv, rows_v))) if rows_k == rows_v && !kd.is_empty() => Ok(dv),
        _ => bail!(
            "sdpa-candle: k is {:?} and v is {:?}; they must match but for the head dim (the last)",
            k.shape(),
            v.shape()
        ),
    }
}

/// The output's shape: Q's, with the last dimension (the head dim) V's.
pub(crate) fn out_shape(q: &Layout, head_dim_v: usize) -> Shape {
    let mut dims = q.shape().dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = head_dim_v;
    }
    Shape::from(dims)
}

/// That each named layout has a contiguous last dimension (head_dim), as the kernels read rows.
pub(crate) fn last_dim_contiguous<'a>(
    layouts: impl IntoIterator<Item = (&'a str, &'a Layout)>,
) -> Result<()> {
    for (name, l) in layouts {
        if l.stride().last() != Some(&1) {
            bail!(
                "sdpa-candle: the last dimension of {name} must be contiguous (strides {:?})",
                l.stride()
            );
        }
    }
    Ok(())
}

/// The strides of a `(batch, seq, heads, head_dim)` layout as sdpa names them.
pub(crate) fn strides_bshd(l: &Layout) -> Strides {
    let s = l.stride();
    Strides {
        batch: s[0],
        seq: s[1],
        head: s[2],
    }
}

/// The strides of a packed `(total, heads, head_dim)` layout: one batch entry of `total` rows
/// (its batch stride, never stepped, the one a leading dimension of size 1 would have).
pub(crate) fn strides_packed(l: &Layout) -> Strides {
    let (d, s) = (l.dims(), l.stride());
    Strides {
        batch: d[0] * s[0],
        seq: s[0],
        head: s[1],
    }
}

/// How a paged cache `(pages, page_size, kv_heads, head_dim)` is stored, and its strides as sdpa
/// reads it (the row space of `Problem::k_shape`): pages whose rows follow each other (NHD, any
/// row and head strides), or pages stored head after head, each head's rows contiguous (HND,
/// such as a `(pages, kv_heads, page_size, head_dim)` cache transposed to this shape).
pub(crate) fn paged_layout(name: &str, l: &Layout) -> Result<(sdpa::PageLayout, Strides)> {
    let (d, s) = (l.dims(), l.stride());
    let (page_size, heads, head_dim) = (d[1], d[2], d[3]);
    let strides = Strides {
        batch: d[0] * s[0],
        seq: s[1],
        head: s[2],
    };
    if s[0] == page_size * s[1] {
        return Ok((sdpa::PageLayout::Nhd, strides));
    }
    if (s[1], s[2], s[0]) == (head_dim, page_size * head_dim, heads * page_size * head_dim) {
        return Ok((sdpa::PageLayout::Hnd, strides));
    }
    bail!(
        "sdpa-candle: {name}'s pages must be stored row after row (NHD) or head after head with \
         contiguous rows (HND); strides {s:?} of shape {:?} are neither",
        l.shape()
    )
}

pub(crate) use sdpa::Strides;

/// `t`, which must be on the CPU with Q, K and V.
pub(crate) fn on_cpu<'t>(name: &str, t: &'t Tensor) -> Result<&'t Tensor> {
    if !t.device().is_cpu() {
        bail!("sdpa-candle: {name} must be on the CPU with q, k and v");
    }
    Ok(t)
}

/// The f16 or bf16 elements `l` addresses in `s`, in row-major order, as f64 (the reference's
/// input).
pub(crate) fn values(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    Ok(match s {
        CpuStorage::F16(x) => gather(x, l, |e| f64::from(e.to_f32())),
        CpuStorage::BF16(x) => gather(x, l, |e| f64::from(e.to_f32())),
        other => bail!("sdpa-candle: {:?} storage", other.dtype()),
    })
}

/// The reference's f64 output as CPU storage of `dtype` (f16, else bf16).
pub(crate) fn storage(dtype: DType, out: &[f64]) -> CpuStorage {
    match dtype {
        DType::F16 => CpuStorage::F16(out.iter().map(|&x| f16::from_f64(x)).collect()),
        _ => CpuStorage::BF16(out.iter().map(|&x| bf16::from_f64(x)).collect()),
    }
}

/// The elements a layout addresses in `data`, in row-major order, converted by `f`: each row (the
/// last dimension, contiguous) copied whole.
fn gather<T: Copy>(data: &[T], l: &Layout, f: impl Fn(T) -> f64) -> Vec<f64> {
    let (dims, strides) = (l.dims(), l.stride());
    let (leading, row_len) = (&dims[..dims.len() - 1], dims[dims.len() - 1]);
    let rows: usize = leading.iter().product();
    let mut out = Vec::with_capacity(l.shape().elem_count());
    for r in 0..rows {
        // Row r's index in each leading dimension, innermost first, gives its offset.
        let (mut rest, mut at) = (r, l.start_offset());
        for (&n, &stride) in leading.iter().zip(strides).rev() {
            at += (rest % n) * stride;
            rest /= n;
        }
        out.extend(data[at..at + row_len].iter().map(|&x| f(x)));
    }
    out
}

/// How many offsets a `seqlens` tensor holds, having checked it is a contiguous u32 vector.
pub(crate) fn offsets_count(name: &'static str, t: &Tensor) -> Result<usize> {
    if t.dtype() != DType::U32 {
        return Err(Error::UnexpectedDType {
            msg: match name {
                "seqlens_q" => "sdpa-candle: seqlens_q holds u32 offsets",
                _ => "sdpa-candle: seqlens_k holds u32 offsets",
            },
            expected: DType::U32,
            got: t.dtype(),
        }
        .bt());
    }
    let n = t
        .dims1()
        .map_err(|e| e.context(format!("sdpa-candle: {name} must be (batch + 1,)")))?;
    if !t.is_contiguous() {
        bail!("sdpa-candle: {name} must be contiguous");
    }
    Ok(n)
}

/// The offsets of a CPU `seqlens` tensor as i32, each checked to fit.
pub(crate) fn offsets(name: &str, t: &Tensor) -> Result<Vec<i32>> {
    on_cpu(name, t)?
        .to_vec1::<u32>()?
        .into_iter()
        .enumerate()
        .map(|(i, x)| {
            i32::try_from(x).map_err(|_| {
                Error::msg(format!(
                    "sdpa-candle: {name}[{i}] = {x} does not fit i32 (offsets are below 2^31)"
                ))
            })
        })
        .collect()
}

/// Each sequence's length from its offsets, which must not decrease.
pub(crate) fn lengths(name: &str, offsets: &[i32]) -> Result<Vec<i32>> {
    offsets
        .windows(2)
        .enumerate()
        .map(|(b, w)| {
            if w[1] < w[0] {
                bail!(
                    "sdpa-candle: {name} decreases from {} to {} at sequence {b}",
                    w[0],
                    w[1]
                );
            }
            Ok(w[1] - w[0])
        })
        .collect()
}

/// That a block table is a contiguous `(batch, pages_per_seq)` matrix of u32 or i32 page
/// indices; its column count.
pub(crate) fn block_table_columns(t: &Tensor, batch: usize) -> Result<usize> {
    if !matches!(t.dtype(), DType::U32 | DType::I32) {
        bail!(
            "sdpa-candle: block_table holds {:?}; it must hold u32 or i32 page indices",
            t.dtype()
        );
    }
    let (rows, cols) = t
        .dims2()
        .map_err(|e| e.context("sdpa-candle: block_table must be (batch, pages_per_seq)"))?;
    if rows != batch {
        bail!("sdpa-candle: block_table has {rows} rows for {batch} sequences");
    }
    if !t.is_contiguous() {
        bail!("sdpa-candle: block_table must be contiguous");
    }
    Ok(cols)
}

/// A CPU block table's entries as i32, each checked to fit.
pub(crate) fn block_table(t: &Tensor) -> Result<Vec<i32>> {
    let t = on_cpu("block_table", t)?.flatten_all()?;
    if t.dtype() == DType::I32 {
        return t.to_vec1::<i32>();
    }
    t.to_vec1::<u32>()?
        .into_iter()
        .map(|x| {
            i32::try_from(x)
                .map_err(|_| Error::msg(format!("sdpa-candle: block_table entry {x} is past 2^31")))
        })
        .collect()
}
