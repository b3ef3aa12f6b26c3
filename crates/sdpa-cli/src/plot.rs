//! SVG charts of bench records: TFLOP/s per problem, one bar per backend of ours and per anchor,
//! with the 95% interval of the median as a whisker where the record has one.

use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

/// One bar: a backend's (or an anchor's) throughput on one problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// The problem's label (x axis).
    pub problem: String,
    /// The backend or anchor (legend).
    pub series: String,
    /// TFLOP/s at the median.
    pub tflops: f64,
    /// TFLOP/s at the ends of the median's 95% interval.
    pub ci: Option<(f64, f64)>,
    /// An anchor (drawn in warm colours), not one of ours (cool colours).
    pub anchor: bool,
}

/// The shape of a record: what ours and the anchors' records are matched on.
pub type Key = (u64, u64, u64, u64, u64, bool, String);

/// The key of a bench or anchor record (`None`: a field is missing).
pub fn key(r: &Value) -> Option<Key> {
    let n = |f: &str| r[f].as_u64();
    Some((
        n("batch")?,
        n("heads")?,
        n("seq_q")?,
        n("seq_k")?,
        n("head_dim")?,
        r["causal"].as_bool()?,
        r["dtype"].as_str()?.to_string(),
    ))
}

/// A problem's label: its name where the record has one, else its shape; then its dtype
/// ([`record_dtype`]: fast and accurate e4m3 records are apart).
pub fn label(r: &Value) -> String {
    match (r["name"].as_str(), key(r)) {
        (Some(name), Some(_)) => format!("{name} {}", record_dtype(r)),
        (None, Some((b, h, sq, sk, d, causal, _))) => format!(
            "B{b} H{h} {sq}x{sk} D{d}{} {}",
            if causal { " causal" } else { "" },
            record_dtype(r)
        ),
        _ => "?".into(),
    }
}

/// A record's dtype as tables show it: with `/fast` where it ran in the fast FP8 mode (records
/// without the field, the anchors' among them, are as their dtype says).
pub fn record_dtype(r: &Value) -> String {
    let dtype = r["dtype"].as_str().unwrap_or("");
    match r["fp8_mode"].as_str() {
        Some("fast") => format!("{dtype}/fast"),
        _ => dtype.to_string(),
    }
}

/// The bar of record `r` under `problem`, or `None` when it has no TFLOP/s figure.
pub fn bar(r: &Value, problem: &str, anchor: bool) -> Option<Bar> {
    let tflops = r["tflops"].as_f64().filter(|t| t.is_finite() && *t > 0.0)?;
    let us = r["us_graph"].as_f64()?;
    // TFLOP/s is inversely proportional to time: the slow end of the interval is the low one.
    let ci = r["us_graph_ci95"].as_array().and_then(|c| {
        let (lo, hi) = (c.first()?.as_f64()?, c.get(1)?.as_f64()?);
        (lo > 0.0 && hi > 0.0).then(|| (tflops * us / hi, tflops * us / lo))
    });
    Some(Bar {
        problem: problem.to_string(),
        series: r["backend"].as_str().unwrap_or("?").to_string(),
        tflops,
        ci,
        anchor,
    })
}

const OURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(23, 190, 207),
    RGBColor(148, 103, 189),
    RGBColor(65, 68, 81),
    RGBColor(0, 90, 50),
];
const ANCHORS: [RGBColor; 5] = [
    RGBColor(255, 127, 14),
    RGBColor(214, 39, 40),
    RGBColor(188, 189, 34),
    RGBColor(227, 119, 194),
    RGBColor(140, 86, 75),
];

/// Writes a grouped bar chart of `bars` to `path` (SVG): problems along x in the order they
/// first appear, within each our backends first, then the anchors.
pub fn write_svg(path: &Path, title: &str, bars: &[Bar]) -> sdpa::Result<()> {
    let io = |msg: String| sdpa::Error::Io {
        path: path.display().to_string(),
        msg,
    };
    if bars.is_empty() {
        return Err(io("no record with a TFLOP/s figure to plot".into()));
    }
    let mut problems: Vec<&str> = Vec::new();
    let mut series: Vec<(&str, bool)> = Vec::new();
    for b in bars {
        if !problems.contains(&b.problem.as_str()) {
            problems.push(&b.problem);
        }
        if !series.iter().any(|(s, _)| *s == b.series) {
            series.push((&b.series, b.anchor));
        }
    }
    series.sort_by_key(|&(_, anchor)| anchor);
    let color = |i: usize| {
        let (name, anchor) = series[i];
        let rank = series[..i].iter().filter(|s| s.1 == anchor).count();
        let c = if anchor {
            ANCHORS[rank % ANCHORS.len()]
        } else {
            OURS[rank % OURS.len()]
        };
        (name, c)
    };
    let top = bars
        .iter()
        .map(|b| b.ci.map_or(b.tflops, |c| c.1.max(b.tflops)))
        .fold(0.0, f64::max)
        * 1.12;
    let width = (160 * problems.len()).max(900) as u32;
    let root = SVGBackend::new(path, (width, 620)).into_drawing_area();
    let draw = |e: String| io(format!("drawing the chart: {e}"));
    root.fill(&WHITE).map_err(|e| draw(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(70)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..problems.len() as f64, 0f64..top)
        .map_err(|e| draw(e.to_string()))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(problems.len() * 2 + 1)
        .x_label_formatter(&|x| {
            // Labels at the centres of the groups only.
            let i = x.floor() as usize;
            let centred = (x - x.floor() - 0.5).abs() < 1e-6;
            if centred && i < problems.len() {
                problems[i].to_string()
            } else {
                String::new()
            }
        })
        .x_label_style(("sans-serif", 13))
        .y_desc("TFLOP/s (median; whisker: 95% interval)")
        .draw()
        .map_err(|e| draw(e.to_string()))?;
    let slot = 0.8 / series.len() as f64;
    for i in 0..series.len() {
        let (name, c) = color(i);
        let offset = 0.1 + slot * i as f64;
        let mine: Vec<(f64, &Bar)> = bars
            .iter()
            .filter(|b| b.series == name)
            .map(|b| {
                let p = problems.iter().position(|&p| p == b.problem).unwrap_or(0);
                (p as f64 + offset, b)
            })
            .collect();
        chart
            .draw_series(
                mine.iter().map(|&(x, b)| {
                    Rectangle::new([(x, 0.0), (x + slot * 0.92, b.tflops)], c.filled())
                }),
            )
            .map_err(|e| draw(e.to_string()))?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
        chart
            .draw_series(mine.iter().filter_map(|&(x, b)| {
                let (lo, hi) = b.ci?;
                let mid = x + slot * 0.46;
                Some(ErrorBar::new_vertical(
                    mid,
                    lo,
                    b.tflops,
                    hi,
                    BLACK.stroke_width(1),
                    6,
                ))
            }))
            .map_err(|e| draw(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| draw(e.to_string()))?;
    root.present().map_err(|e| draw(e.to_string()))?;
    Ok(())
}
