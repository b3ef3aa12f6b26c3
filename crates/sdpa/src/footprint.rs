//! The device memory an operand covers, and the checks on it that keep a kernel's reads and
//! writes inside the caller's buffers: on the right GPU, 16-byte aligned, in bounds, the output
//! apart from every input and each of its elements at its own address.

use crate::device::Device;
use crate::error::{Result, invalid};
use crate::problem::{Strides, TensorShape};
use cudarc::driver::DevicePtr;
use std::ops::Range;

/// The byte range a view's strides reach inside its buffer, having checked the buffer's GPU, its
/// alignment, and that it holds every element `shape` addresses.
pub(crate) fn span<T>(
    name: &str,
    dev: &Device,
    data: &impl DevicePtr<T>,
    s: Strides,
    shape: TensorShape,
) -> Result<Range<u64>> {
    let stream = data.stream();
    if stream.context() != dev.ctx() {
        return Err(invalid!(
            "{name} lives on another GPU than the device handle"
        ));
    }
    let es = std::mem::size_of::<T>();
    // Where the kernels run over a dimension, its stride must keep rows 16-byte aligned.
    for (dim, size, stride) in [
        ("batch", shape.batch, s.batch),
        ("head", shape.heads, s.head),
        ("seq", shape.seq, s.seq),
    ] {
        if size > 1 && !(stride * es).is_multiple_of(16) {
            return Err(invalid!(
                "{name}'s {dim} stride {stride} is not a multiple of {} elements (16 bytes): \
                 the kernels read rows 16 bytes at a time",
                16 / es
            ));
        }
    }
    let (ptr, _g) = data.device_ptr(stream);
    if !ptr.is_multiple_of(16) {
        return Err(invalid!(
            "{name} starts at {ptr:#x}, not 16-byte aligned: the kernels read rows 16 bytes at a \
             time"
        ));
    }
    let last = [
        (shape.batch, s.batch),
        (shape.heads, s.head),
        (shape.seq, s.seq),
    ]
    .iter()
    .try_fold(shape.head_dim, |acc, &(n, st)| {
        (n - 1).checked_mul(st)?.checked_add(acc)
    });
    match last {
        Some(n) if n <= data.len() => Ok(ptr..ptr + (n * es) as u64),
        _ => Err(invalid!(
            "{name} holds {} elements; shape {shape} at strides {s:?} reaches beyond them",
            data.len()
        )),
    }
}

/// That the output's bytes `out` overlap none of the `inputs` the kernels read while writing it.
pub(crate) fn out_apart(out: &Range<u64>, inputs: &[(&str, &Range<u64>)]) -> Result<()> {
    apart("out", out, inputs)
}

/// That the bytes of the written operand `written` overlap none of `others` (the inputs the
/// kernels read while writing it, and the call's other outputs).
pub(crate) fn apart(
    written: &str,
    span: &Range<u64>,
    others: &[(&str, &Range<u64>)],
) -> Result<()> {
    match others
        .iter()
        .find(|(_, r)| r.start < span.end && span.start < r.end)
    {
        Some((name, _)) => Err(invalid!(
            "{written} overlaps {name}: the kernels read or write {name} while {written} is written"
        )),
        None => Ok(()),
    }
}

/// That the output's strides give each element its own address: ordered by stride, each
/// dimension it runs over steps past everything the inner ones span (a zero or overlapping
/// stride would have two CTAs write one element).
pub(crate) fn rows_distinct(name: &str, s: Strides, shape: TensorShape) -> Result<()> {
    let mut dims = [
        (s.seq, shape.seq),
        (s.head, shape.heads),
        (s.batch, shape.batch),
    ];
    dims.sort();
    let mut spanned = shape.head_dim;
    for (stride, size) in dims.into_iter().filter(|&(_, n)| n > 1) {
        if stride < spanned {
            return Err(invalid!(
                "{name}'s strides {s:?} make elements of shape {shape} share addresses"
            ));
        }
        spanned += stride * (size - 1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Layout;

    fn shape(batch: usize, heads: usize, seq: usize) -> TensorShape {
        TensorShape {
            batch,
            heads,
            seq,
            head_dim: 64,
            layout: Layout::Bhsd,
        }
    }

    #[test]
    fn the_output_may_touch_but_not_overlap_an_input() {
        let (q, scales) = (100..200, 300..304);
        out_apart(&(200..300), &[("q", &q), ("q's scales", &scales)]).unwrap();
        let e = out_apart(&(302..400), &[("q", &q), ("q's scales", &scales)]).unwrap_err();
        assert!(e.to_string().contains("out overlaps q's scales"), "{e}");
        let e = out_apart(&(0..101), &[("q", &q)]).unwrap_err();
        assert!(e.to_string().contains("out overlaps q:"), "{e}");
    }

    #[test]
    fn output_strides_must_give_each_element_its_own_address() {
        let s = shape(2, 4, 100);
        let dense = Strides {
            batch: 4 * 100 * 64,
            head: 100 * 64,
            seq: 64,
        };
        rows_distinct("out", dense, s).unwrap();
        // Sequence-major with padding, and heads interleaved: still distinct.
        rows_distinct(
            "out",
            Strides {
                batch: 100 * 4 * 72,
                head: 72,
                seq: 4 * 72,
            },
            s,
        )
        .unwrap();
        for bad in [
            Strides { seq: 32, ..dense },
            Strides { head: 0, ..dense },
            Strides {
                batch: 100 * 64,
                ..dense
            },
        ] {
            let e = rows_distinct("out", bad, s).unwrap_err();
            assert!(e.to_string().contains("share addresses"), "{bad:?}: {e}");
        }
        // A dimension of size one has no stride to speak of.
        rows_distinct("out", Strides { batch: 0, ..dense }, shape(1, 4, 100)).unwrap();
    }
}
