//! `sdpa autotable BENCH.json`: turns `sdpa bench --json` records into the Rust source of
//! crates/sdpa/src/backend/auto/table.rs, the measured table `Backend::Auto` consults.
//!
//! The input is not trusted: every record is validated (shape, dtype, backend, sm, timing)
//! and the only free text that reaches the output, the device name, is escaped. The whole
//! file is built in memory and printed only when every record passed, so a bad record never
//! leaves half a table behind. Errors name the record as `records[i]` (0-based).

use crate::{CliResult, Failure};
use sdpa::backend::auto::{FALLBACK, SizeClass};
use sdpa::{Backend, DType, Error, Fp8Mode, Problem, Result};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::ops::RangeInclusive;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Records written by `sdpa bench --json`.
    json: std::path::PathBuf,
    /// Compute capability (major*10+minor) for records that lack an "sm" field.
    #[arg(long, allow_negative_numbers = true)]
    sm: Option<u32>,
    /// Device name for records that lack a "device" field.
    #[arg(long, default_value = "an unnamed device")]
    device: String,
}

pub fn main(a: Args) -> CliResult<ExitCode> {
    let path = a.json.display().to_string();
    let io = |msg: String| Error::Io {
        path: path.clone(),
        msg,
    };
    let records = crate::input::read_records(&a.json)?;
    let source = generate(&records, a.sm, &a.device).map_err(|e| match e {
        Error::InvalidArgument(msg) => io(msg),
        other => other,
    })?;
    // A reader that went away (`| head`) ends the command as it ends every other one.
    std::io::stdout()
        .lock()
        .write_all(source.as_bytes())
        .map_err(Failure::Stdout)?;
    Ok(ExitCode::SUCCESS)
}

/// Compute capabilities a record may carry: anything outside is a corrupt field, not a GPU.
const SM_RANGE: RangeInclusive<u64> = 10..=200;

/// One row of the table: the kind of problem and device the row decides for. Variant names are
/// kept as text so rows sort as the checked-in table lists them (Bf16 < E4m3 < F16,
/// Large < Medium < Small, Accurate < Fast).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct RowKey {
    sm: u32,
    dtype: &'static str,
    head_dim: usize,
    causal: bool,
    size: &'static str,
    fp8_mode: &'static str,
}

/// One timed problem: the row it belongs to plus what tells problems of that row apart.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct ProblemKey {
    row: RowKey,
    name: String,
    shape: [usize; 4],
}

/// What one validated record contributes.
#[derive(Debug)]
struct Record {
    problem: ProblemKey,
    backend: Backend,
    us_graph: f64,
    device: Option<String>,
}

/// The Rust source of auto/table.rs for `records`, or the first invalid record's error.
/// `sm` stands in for records without an "sm" field, `device` for records without a "device".
pub fn generate(records: &[Value], sm: Option<u32>, device: &str) -> Result<String> {
    if records.is_empty() {
        return Err(invalid(
            "no records: an empty table would discard every measured row",
        ));
    }
    if let Some(sm) = sm {
        check_sm_range(u64::from(sm)).map_err(|m| invalid(format!("--sm: {m}")))?;
    }
    // Records of an e4m3 K/V cache under 16-bit Q (the -fp8kv problems a default bench writes)
    // are another race than their Q dtype's (fewer backends, half the bytes): left out.
    let parsed = records
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            r.get("kv_dtype")
                .and_then(Value::as_str)
                .is_none_or(|kv| Some(kv) == r.get("dtype").and_then(Value::as_str))
        })
        .map(|(i, r)| parse_record(r, sm).map_err(|m| invalid(format!("records[{i}]: {m}"))))
        .collect::<Result<Vec<Record>>>()?;
    let timings = group_by_problem(&parsed)?;
    let devices: BTreeSet<&str> = parsed.iter().filter_map(|r| r.device.as_deref()).collect();
    let device_line = if devices.is_empty() {
        escape_for_comment(device)
    } else {
        let escaped: Vec<String> = devices.into_iter().map(escape_for_comment).collect();
        escaped.join(", ")
    };
    Ok(render(&device_line, &score_rows(timings)))
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// A library error's message without the "invalid argument: " prefix (the caller adds context).
fn message(e: Error) -> String {
    match e {
        Error::InvalidArgument(m) => m,
        other => other.to_string(),
    }
}

/// Validates one record; the error is the bad field and value, without the record index.
fn parse_record(r: &Value, default_sm: Option<u32>) -> std::result::Result<Record, String> {
    if !r.is_object() {
        return Err(format!("not a JSON object: {}", short(r)));
    }
    let [batch, heads, seq_q, seq_k, head_dim] =
        ["batch", "heads", "seq_q", "seq_k", "head_dim"].map(|k| shape_field(r, k));
    let (batch, heads, seq_q, seq_k, head_dim) = (batch?, heads?, seq_q?, seq_k?, head_dim?);
    let dtype: DType = required_str(r, "dtype")?
        .parse()
        .map_err(|e| format!("dtype: {}", message(e)))?;
    let causal = match r.get("causal") {
        None => false,
        Some(Value::Bool(c)) => *c,
        Some(v) => return Err(format!("causal must be true or false, got {}", short(v))),
    };
    let mut p = Problem::new(batch, heads, seq_q, seq_k, head_dim)
        .with_dtype(dtype)
        .with_causal(causal);
    // Records without the field (or null: f16/bf16) are accurate, as bench writes them.
    let fp8_mode = match r.get("fp8_mode") {
        None | Some(Value::Null) => Fp8Mode::Accurate,
        Some(Value::String(m)) => m.parse().map_err(|e| format!("fp8_mode: {}", message(e)))?,
        Some(v) => return Err(format!("fp8_mode must be a string, got {}", short(v))),
    };
    p = p.with_fp8_mode(fp8_mode);
    if let Some(out) = optional_str(r, "out_dtype")? {
        let out: DType = out
            .parse()
            .map_err(|e| format!("out_dtype: {}", message(e)))?;
        p = p.with_out_dtype(out);
    }
    p.validate()
        .map_err(|e| format!("bad problem: {}", message(e)))?;
    // Rows are keyed by the input dtype and order the backends for its default output; an f32
    // output (cutlass's and cpu's alone) is another race.
    if p.dtype != DType::E4m3 && p.output_dtype() != p.dtype {
        return Err(format!(
            "out_dtype {} of {} inputs: the table orders backends for the inputs' own output \
             dtype; leave records of other outputs out",
            p.output_dtype(),
            p.dtype
        ));
    }
    let backend: Backend = required_str(r, "backend")?
        .parse()
        .map_err(|e| format!("backend: {}", message(e)))?;
    let row = RowKey {
        sm: record_sm(r, default_sm)?,
        dtype: dtype_variant(dtype),
        head_dim,
        causal,
        size: size_variant(SizeClass::of(&p)),
        fp8_mode: fp8_mode_variant(fp8_mode),
    };
    let name = optional_str(r, "name")?.unwrap_or_default().to_string();
    Ok(Record {
        problem: ProblemKey {
            row,
            name,
            shape: [batch, heads, seq_q, seq_k],
        },
        backend,
        us_graph: us_graph(r)?,
        device: optional_str(r, "device")?.map(str::to_string),
    })
}

/// A shape field: a non-negative integer that fits a usize (zero is left to `validate`).
fn shape_field(r: &Value, key: &str) -> std::result::Result<usize, String> {
    let v = r.get(key).ok_or_else(|| format!("no {key:?} field"))?;
    v.as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("{key} must be a non-negative integer, got {}", short(v)))
}

/// The record's "sm", else the --sm default; null counts as absent (bench writes null when it
/// ran without a GPU).
fn record_sm(r: &Value, default_sm: Option<u32>) -> std::result::Result<u32, String> {
    match r.get("sm") {
        None | Some(Value::Null) => default_sm
            .ok_or_else(|| "no \"sm\" field; pass --sm (e.g. 90 for an H100/H200)".to_string()),
        Some(v) => {
            let n = v
                .as_u64()
                .ok_or_else(|| format!("sm must be a non-negative integer, got {}", short(v)))?;
            check_sm_range(n)?;
            u32::try_from(n).map_err(|_| format!("sm {n} does not fit a u32"))
        }
    }
}

fn check_sm_range(sm: u64) -> std::result::Result<(), String> {
    if SM_RANGE.contains(&sm) {
        Ok(())
    } else {
        Err(format!(
            "sm {sm} is outside {}..={} (major*10+minor, e.g. 90)",
            SM_RANGE.start(),
            SM_RANGE.end()
        ))
    }
}

/// The graph-launch time: a finite number of microseconds above zero.
fn us_graph(r: &Value) -> std::result::Result<f64, String> {
    let v = r.get("us_graph").ok_or("no \"us_graph\" field")?;
    match v.as_f64() {
        Some(us) if us.is_finite() && us > 0.0 => Ok(us),
        _ => Err(format!(
            "us_graph must be a finite number > 0, got {}",
            short(v)
        )),
    }
}

fn required_str<'a>(r: &'a Value, key: &str) -> std::result::Result<&'a str, String> {
    optional_str(r, key)?.ok_or_else(|| format!("no {key:?} field"))
}

/// A string field, `None` when absent; any other JSON type is an error.
fn optional_str<'a>(r: &'a Value, key: &str) -> std::result::Result<Option<&'a str>, String> {
    match r.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(format!("{key} must be a string, got {}", short(v))),
    }
}

/// A JSON value for an error line, cut to 60 characters. JSON text escapes control characters
/// inside strings, so the value cannot break the line.
fn short(v: &Value) -> String {
    let text = v.to_string();
    let mut cut: String = text.chars().take(60).collect();
    if cut.len() < text.len() {
        cut.push_str("...");
    }
    cut
}

/// Timings per problem, per backend. Two timings of one backend on one problem would count it
/// twice in the row's score, so they are refused.
fn group_by_problem(records: &[Record]) -> Result<BTreeMap<ProblemKey, Vec<(Backend, f64)>>> {
    let mut problems: BTreeMap<ProblemKey, Vec<(Backend, f64)>> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        let timings = problems.entry(r.problem.clone()).or_default();
        if timings.iter().any(|(b, _)| *b == r.backend) {
            return Err(invalid(format!(
                "records[{i}]: a second timing of backend {} on problem {:?} {:?}",
                r.backend, r.problem.name, r.problem.shape
            )));
        }
        timings.push((r.backend, r.us_graph));
    }
    Ok(problems)
}

/// Each row's backend order: by summed (time / fastest time) over the row's problems, then
/// the `FALLBACK` backends the records did not time. Only GPU backends are listed.
fn score_rows(problems: BTreeMap<ProblemKey, Vec<(Backend, f64)>>) -> Vec<(RowKey, Vec<Backend>)> {
    let mut scores: BTreeMap<RowKey, BTreeMap<&'static str, (Backend, f64)>> = BTreeMap::new();
    for (problem, timings) in problems {
        let best = timings.iter().map(|t| t.1).fold(f64::INFINITY, f64::min);
        let row = scores.entry(problem.row).or_default();
        for (backend, us) in timings {
            row.entry(backend.name()).or_insert((backend, 0.0)).1 += us / best;
        }
    }
    scores
        .into_iter()
        .map(|(key, by_name)| {
            let mut ranked: Vec<(Backend, f64)> = by_name.into_values().collect();
            ranked.sort_by(|x, y| x.1.total_cmp(&y.1));
            let mut order: Vec<Backend> = ranked
                .into_iter()
                .map(|(b, _)| b)
                .filter(|b| Backend::GPU.contains(b))
                .collect();
            for b in FALLBACK {
                if !order.contains(&b) {
                    order.push(b);
                }
            }
            (key, order)
        })
        .collect()
}

/// The generated file. `device` must already be escaped for a comment.
fn render(device: &str, rows: &[(RowKey, Vec<Backend>)]) -> String {
    let mut out = format!(
        "//! Generated by `sdpa autotable` from `sdpa bench --json` on {device}.\n\
         //! Regenerate after changing a kernel (sdpa bench --json, then sdpa autotable); do not edit by hand.\n\
         //! Each order: backends by summed (time / fastest time) over the problems of the row.\n\
         \n\
         use super::row::{{Row, SizeClass::*}};\n\
         use crate::backend::Backend::*;\n\
         use crate::problem::DType::*;\n\
         use crate::problem::Fp8Mode::*;\n\
         \n\
         pub(crate) const TABLE: &[Row] = &[\n"
    );
    for (k, order) in rows {
        let names: Vec<String> = order.iter().map(|b| format!("{b:?}")).collect();
        out.push_str(&format!(
            "    Row {{ sm: {}, dtype: {}, head_dim: {}, causal: {}, size: {}, fp8_mode: {}, \
             order: &[{}] }},\n",
            k.sm,
            k.dtype,
            k.head_dim,
            k.causal,
            k.size,
            k.fp8_mode,
            names.join(", ")
        ));
    }
    out.push_str("];\n");
    out
}

/// The `DType` variant as the generated source names it. A match, not `Debug`, so a new dtype
/// cannot reach the table without someone deciding how it is spelled.
fn dtype_variant(d: DType) -> &'static str {
    match d {
        DType::F16 => "F16",
        DType::Bf16 => "Bf16",
        DType::E4m3 => "E4m3",
        DType::F32 => "F32",
    }
}

fn fp8_mode_variant(m: Fp8Mode) -> &'static str {
    match m {
        Fp8Mode::Accurate => "Accurate",
        Fp8Mode::Fast => "Fast",
    }
}

fn size_variant(s: SizeClass) -> &'static str {
    match s {
        SizeClass::Small => "Small",
        SizeClass::Medium => "Medium",
        SizeClass::Large => "Large",
    }
}

/// Text safe inside a `//!` line: printable ASCII as is, `\` and `"` escaped, everything else
/// (newlines, control characters, bidi overrides that rustc rejects in comments, any non-ASCII)
/// as a `\u{..}` escape, so the text can neither end the comment line nor break the build.
fn escape_for_comment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            ' '..='~' => out.push(c),
            _ => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A valid H200 record of the mission shape (2^20 scores: Small), merged with `extra`.
    fn record(backend: &str, us: f64, extra: Value) -> Value {
        let mut r = json!({
            "name": "mission", "batch": 1, "heads": 16, "seq_q": 256, "seq_k": 256,
            "head_dim": 64, "causal": false, "dtype": "f16", "out_dtype": "f16",
            "backend": backend, "us_graph": us, "device": "NVIDIA H200", "sm": 90,
        });
        for (k, v) in extra.as_object().expect("extra is an object") {
            r[k] = v.clone();
        }
        r
    }

    fn without(mut r: Value, key: &str) -> Value {
        r.as_object_mut().expect("record is an object").remove(key);
        r
    }

    /// The InvalidArgument message of a failed `generate`; fails the test on Ok or another kind.
    fn error_of(records: &[Value]) -> String {
        match generate(records, None, "fallback device") {
            Err(Error::InvalidArgument(m)) => m,
            Err(e) => panic!("expected InvalidArgument, got {e:?}"),
            Ok(s) => panic!("expected an error, got output:\n{s}"),
        }
    }

    fn rows_of(source: &str) -> Vec<&str> {
        source
            .lines()
            .filter(|l| l.trim_start().starts_with("Row {"))
            .collect()
    }

    #[test]
    fn two_valid_records_make_one_row_fastest_first() {
        let records = [
            record("wmma", 30.0, json!({})),
            record("cutlass", 10.0, json!({})),
        ];
        let source = generate(&records, None, "unused").unwrap();
        assert_eq!(
            rows_of(&source),
            [
                "    Row { sm: 90, dtype: F16, head_dim: 64, causal: false, size: Small, \
              fp8_mode: Accurate, order: &[Cutlass, Wmma, CutlassSm80, Cublas, Scalar] },"
            ]
        );
        assert!(source.starts_with(
            "//! Generated by `sdpa autotable` from `sdpa bench --json` on NVIDIA H200.\n"
        ));
        assert!(source.contains("pub(crate) const TABLE: &[Row] = &[\n"));
        assert!(source.ends_with("];\n"));
    }

    #[test]
    fn rows_sort_like_the_checked_in_table_and_scores_sum_over_problems() {
        // Two problems of one row: cublas wins one by a little, wmma the other by a lot, so
        // wmma's summed ratio (1 + 1.05) beats cublas's (3 + 1).
        let records = [
            record("cublas", 30.0, json!({"name": "a"})),
            record("wmma", 10.0, json!({"name": "a"})),
            record("cublas", 20.0, json!({"name": "b"})),
            record("wmma", 21.0, json!({"name": "b"})),
            record(
                "wmma",
                5.0,
                json!({"dtype": "bf16", "out_dtype": "bf16", "causal": true}),
            ),
        ];
        let source = generate(&records, None, "unused").unwrap();
        let rows = rows_of(&source);
        assert_eq!(rows.len(), 2);
        assert!(
            rows[0].contains("dtype: Bf16, head_dim: 64, causal: true"),
            "{}",
            rows[0]
        );
        assert!(rows[0].ends_with("order: &[Wmma, Cutlass, CutlassSm80, Cublas, Scalar] },"));
        assert!(
            rows[1].contains("dtype: F16, head_dim: 64, causal: false"),
            "{}",
            rows[1]
        );
        assert!(rows[1].ends_with("order: &[Wmma, Cublas, Cutlass, CutlassSm80, Scalar] },"));
    }

    #[test]
    fn e4m3_records_become_e4m3_rows_not_bf16() {
        let records = [record(
            "cutlass",
            8.0,
            json!({"dtype": "e4m3", "out_dtype": "f16"}),
        )];
        let source = generate(&records, None, "unused").unwrap();
        let rows = rows_of(&source);
        assert_eq!(rows.len(), 1);
        assert!(rows[0].contains("dtype: E4m3,"), "{}", rows[0]);
        assert!(!source.contains("Bf16"), "{source}");
    }

    /// Bench times e4m3 problems in both modes: each mode is its own row (the same problem
    /// and backend once per mode is not a duplicate), records without the field are accurate,
    /// and a fast f16 record is refused by the library's validation.
    #[test]
    fn fp8_modes_make_rows_of_their_own() {
        let e4m3 = |b: &str, us: f64, mode: Value| {
            record(
                b,
                us,
                json!({"dtype": "e4m3", "out_dtype": "f16", "fp8_mode": mode}),
            )
        };
        let records = [
            e4m3("cutlass", 8.0, json!("accurate")),
            e4m3("wmma", 6.0, json!("accurate")),
            e4m3("cutlass", 4.0, json!("fast")),
            e4m3("wmma", 6.0, json!("fast")),
            record("wmma", 5.0, json!({"fp8_mode": null})),
        ];
        let source = generate(&records, None, "unused").unwrap();
        let rows = rows_of(&source);
        assert_eq!(rows.len(), 3, "{source}");
        assert!(
            rows[0].contains("dtype: E4m3,")
                && rows[0].ends_with(
                    "fp8_mode: Accurate, order: &[Wmma, Cutlass, CutlassSm80, Cublas, Scalar] },"
                ),
            "{}",
            rows[0]
        );
        assert!(
            rows[1].ends_with(
                "fp8_mode: Fast, order: &[Cutlass, Wmma, CutlassSm80, Cublas, Scalar] },"
            ),
            "{}",
            rows[1]
        );
        assert!(rows[2].contains("dtype: F16,") && rows[2].contains("fp8_mode: Accurate,"));
        assert!(source.contains("use crate::problem::Fp8Mode::*;\n"));
        let m = error_of(&[record("wmma", 5.0, json!({"fp8_mode": "fast"}))]);
        assert!(
            m.starts_with("records[0]: bad problem: fp8 mode fast needs e4m3 inputs"),
            "{m}"
        );
        let m = error_of(&[e4m3("wmma", 5.0, json!("quick"))]);
        assert!(
            m.starts_with("records[0]: fp8_mode: unknown fp8 mode \"quick\""),
            "{m}"
        );
        let m = error_of(&[e4m3("wmma", 5.0, json!(1))]);
        assert_eq!(m, "records[0]: fp8_mode must be a string, got 1");
    }

    #[test]
    fn every_input_dtype_has_a_variant_that_round_trips() {
        for d in DType::INPUTS {
            assert_eq!(format!("{d:?}"), dtype_variant(d));
        }
        for m in Fp8Mode::ALL {
            assert_eq!(format!("{m:?}"), fp8_mode_variant(m));
        }
    }

    #[test]
    fn a_newline_in_the_device_cannot_start_a_line_of_code() {
        let evil = "H200.\npub fn injected() {}\r\n// \"quoted\" \\ \u{202e}\u{7}";
        let records = [record("wmma", 10.0, json!({"device": evil}))];
        let source = generate(&records, None, "unused").unwrap();
        let first = source.lines().next().unwrap();
        assert_eq!(
            first,
            "//! Generated by `sdpa autotable` from `sdpa bench --json` on H200.\\u{a}pub fn \
             injected() {}\\u{d}\\u{a}// \\\"quoted\\\" \\\\ \\u{202e}\\u{7}."
        );
        // Every line is one the generator writes itself: nothing else can appear.
        let ours = |l: &str| {
            l.is_empty()
                || l.starts_with("//! ")
                || l.starts_with("use ")
                || l == "pub(crate) const TABLE: &[Row] = &["
                || l.starts_with("    Row { sm: ")
                || l == "];"
        };
        assert!(source.lines().all(ours), "{source}");
        assert_eq!(source.lines().count(), 12);
        assert!(
            source
                .chars()
                .all(|c| c == '\n' || (' '..='~').contains(&c))
        );
    }

    #[test]
    fn the_fallback_device_name_is_escaped_too() {
        let records = [without(record("wmma", 10.0, json!({})), "device")];
        let source = generate(&records, None, "a\nb").unwrap();
        assert!(source.starts_with(
            "//! Generated by `sdpa autotable` from `sdpa bench --json` \
                                    on a\\u{a}b.\n"
        ));
    }

    #[test]
    fn a_non_string_device_is_refused() {
        let m = error_of(&[record("wmma", 10.0, json!({"device": 7}))]);
        assert_eq!(m, "records[0]: device must be a string, got 7");
    }

    #[test]
    fn an_sm_that_wraps_a_u32_is_refused_not_truncated() {
        let m = error_of(&[record("wmma", 10.0, json!({"sm": 4294967387u64}))]);
        assert_eq!(
            m,
            "records[0]: sm 4294967387 is outside 10..=200 (major*10+minor, e.g. 90)"
        );
    }

    #[test]
    fn sm_must_be_a_sane_integer() {
        for (sm, shown) in [
            (json!(0), "sm 0 is outside"),
            (json!(201), "sm 201 is outside"),
            (json!(-90), "sm must be a non-negative integer, got -90"),
            (json!(9.5), "sm must be a non-negative integer, got 9.5"),
            (json!("90"), "sm must be a non-negative integer, got \"90\""),
        ] {
            let m = error_of(&[record("wmma", 10.0, json!({ "sm": sm }))]);
            assert!(m.starts_with(&format!("records[0]: {shown}")), "{m}");
        }
    }

    #[test]
    fn sm_comes_from_the_flag_when_records_lack_it_and_the_flag_is_checked() {
        let r = without(record("wmma", 10.0, json!({})), "sm");
        let source = generate(std::slice::from_ref(&r), Some(80), "d").unwrap();
        assert!(rows_of(&source)[0].contains("sm: 80,"));
        let null_sm = record("wmma", 10.0, json!({"sm": null}));
        let source = generate(&[null_sm], Some(89), "d").unwrap();
        assert!(rows_of(&source)[0].contains("sm: 89,"));
        let m = error_of(std::slice::from_ref(&r));
        assert!(
            m.starts_with("records[0]: no \"sm\" field; pass --sm"),
            "{m}"
        );
        match generate(&[r], Some(4000), "d") {
            Err(Error::InvalidArgument(m)) => assert!(m.starts_with("--sm: sm 4000 is outside")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn us_graph_must_be_a_finite_positive_number() {
        for (bad, shown) in [
            (json!(0), "0"),
            (json!(0.0), "0.0"),
            (json!(-1), "-1"),
            (json!(-1e-9), "-1e-9"),
            (json!("12.5"), "\"12.5\""),
            (json!(null), "null"),
        ] {
            let m = error_of(&[record("wmma", 10.0, json!({ "us_graph": bad }))]);
            assert_eq!(
                m,
                format!("records[0]: us_graph must be a finite number > 0, got {shown}")
            );
        }
        let m = error_of(&[without(record("wmma", 10.0, json!({})), "us_graph")]);
        assert_eq!(m, "records[0]: no \"us_graph\" field");
    }

    #[test]
    fn a_json_number_too_large_for_f64_cannot_reach_the_table() {
        // JSON has no NaN or infinity; the nearest thing, an overflowing literal, fails to parse.
        let parsed: std::result::Result<Vec<Value>, _> =
            serde_json::from_str(r#"[{"us_graph": 1e400}]"#);
        assert!(parsed.is_err());
    }

    #[test]
    fn shapes_are_validated_by_the_library() {
        let m = error_of(&[record("wmma", 10.0, json!({"heads": 0}))]);
        assert_eq!(
            m,
            "records[0]: bad problem: heads must be at least 1, got 0"
        );
        let m = error_of(&[record("wmma", 10.0, json!({"seq_q": -4}))]);
        assert_eq!(
            m,
            "records[0]: seq_q must be a non-negative integer, got -4"
        );
        let m = error_of(&[without(record("wmma", 10.0, json!({})), "head_dim")]);
        assert_eq!(m, "records[0]: no \"head_dim\" field");
        let huge = json!({"batch": 1u64 << 40, "seq_q": 1u64 << 20});
        let m = error_of(&[record("wmma", 10.0, huge)]);
        assert!(m.starts_with("records[0]: bad problem: "), "{m}");
        let m = error_of(&[record("wmma", 10.0, json!({"out_dtype": "bf16"}))]);
        assert!(
            m.starts_with("records[0]: bad problem: output dtype bf16 differs"),
            "{m}"
        );
        let m = error_of(&[record("cutlass", 10.0, json!({"out_dtype": "f32"}))]);
        assert!(
            m.starts_with("records[0]: out_dtype f32 of f16 inputs: the table orders"),
            "{m}"
        );
    }

    #[test]
    fn causal_dtype_and_backend_must_be_present_and_parse() {
        let cases = [
            (
                json!({"causal": "yes"}),
                "records[0]: causal must be true or false, got \"yes\"",
            ),
            (
                json!({"causal": 1}),
                "records[0]: causal must be true or false, got 1",
            ),
            (
                json!({"dtype": "f64"}),
                "records[0]: dtype: unknown dtype \"f64\"",
            ),
            (
                json!({"dtype": "f32"}),
                "records[0]: bad problem: the inputs are f32: f32 is an output type only",
            ),
            (
                json!({"dtype": 16}),
                "records[0]: dtype must be a string, got 16",
            ),
            (
                json!({"backend": "?"}),
                "records[0]: backend: unknown backend \"?\"",
            ),
        ];
        for (extra, expected) in cases {
            let m = error_of(&[record("wmma", 10.0, extra)]);
            assert!(m.starts_with(expected), "{m}");
        }
        for key in ["dtype", "backend"] {
            let m = error_of(&[without(record("wmma", 10.0, json!({})), key)]);
            assert_eq!(m, format!("records[0]: no {key:?} field"));
        }
        let m = error_of(&[json!("not a record")]);
        assert_eq!(m, "records[0]: not a JSON object: \"not a record\"");
    }

    #[test]
    fn a_bad_record_after_good_ones_yields_no_output_at_all() {
        // `generate` returns only an error, and `main` prints nothing unless it returns Ok: neither
        // the header nor the rows before the bad record.
        let records = [
            record("wmma", 10.0, json!({})),
            record("cutlass", 8.0, json!({"name": "other", "head_dim": 128})),
            record("cublas", 0.0, json!({})),
        ];
        let m = error_of(&records);
        assert_eq!(
            m,
            "records[2]: us_graph must be a finite number > 0, got 0.0"
        );
        assert!(!m.contains("Row"));
    }

    #[test]
    fn a_backend_timed_twice_on_one_problem_is_refused() {
        let records = [
            record("wmma", 10.0, json!({})),
            record("wmma", 11.0, json!({})),
        ];
        let m = error_of(&records);
        assert!(
            m.starts_with("records[1]: a second timing of backend wmma on problem"),
            "{m}"
        );
    }

    #[test]
    fn no_records_is_an_error_not_an_empty_table() {
        assert_eq!(
            error_of(&[]),
            "no records: an empty table would discard every measured row"
        );
    }

    #[test]
    fn cpu_and_auto_timings_are_not_listed_in_an_order() {
        let records = [
            record("cpu", 1.0, json!({})),
            record("auto", 2.0, json!({})),
            record("scalar", 3.0, json!({})),
        ];
        let source = generate(&records, None, "d").unwrap();
        assert!(
            rows_of(&source)[0]
                .ends_with("order: &[Scalar, Cutlass, CutlassSm80, Wmma, Cublas] },")
        );
    }
}
