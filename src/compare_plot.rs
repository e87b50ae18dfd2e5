//! The PNG of `meshgrad compare --plot`: every run's loss curve (validation losses as dots) and,
//! below, each run's relative loss difference from the first run on a log scale.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use meshgrad_parallel::compare::relative_difference;
use meshgrad_parallel::metrics::RunMetrics;

/// DejaVu Sans Mono (Bitstream Vera license: assets/fonts/LICENSE-DejaVu.txt), built in so the
/// chart has text on machines without fonts.
static FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSansMono.ttf");

/// Relative differences of exactly 0 are drawn at this value (a log scale has no 0).
const FLOOR: f64 = 1e-10;

/// Line colours (the "tab10" palette), reused in turn when there are more runs.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn color(i: usize) -> RGBAColor {
    COLORS[i % COLORS.len()].to_rgba()
}

const WIDTH: u32 = 1100;
const HEIGHT: u32 = 820;

/// Draws the loss curves of `runs` (the first is the reference) into the PNG `path`.
pub fn draw(runs: &[RunMetrics], path: &Path) -> Result<()> {
    register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow!("the built-in chart font could not be loaded"))?;
    draw_charts(runs, path)
        .with_context(|| format!("drawing the loss curves to {}", path.display()))
}

/// A series of (step, value) points.
type Points = Vec<(f64, f64)>;

fn finite_points(run: &RunMetrics, val: bool) -> Points {
    run.steps
        .iter()
        .filter_map(|(&s, m)| {
            let v = if val { m.val_loss? } else { m.loss };
            v.is_finite().then_some((s as f64, v))
        })
        .collect()
}

fn padded(lo: f64, hi: f64) -> (f64, f64) {
    let pad = ((hi - lo) * 0.05).max(hi.abs().max(1.0) * 1e-6);
    (lo - pad, hi + pad)
}

fn draw_charts(runs: &[RunMetrics], path: &Path) -> Result<()> {
    let reference = &runs[0];
    // Per run: (training losses, validation losses).
    let curves: Vec<(Points, Points)> = runs
        .iter()
        .map(|r| (finite_points(r, false), finite_points(r, true)))
        .collect();
    let all = curves.iter().flat_map(|(l, v)| l.iter().chain(v));
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        return Err(anyhow!("no finite losses to draw"));
    }
    let (x0, x1) = if x0 == x1 {
        (x0 - 1.0, x1 + 1.0)
    } else {
        (x0, x1)
    };
    let (y0, y1) = padded(y0, y1);

    let diffs: Vec<Points> = runs[1..]
        .iter()
        .map(|run| {
            run.steps
                .iter()
                .filter_map(|(s, m)| {
                    let r = relative_difference(reference.steps.get(s)?.loss, m.loss);
                    r.is_finite().then_some((*s as f64, r.max(FLOOR)))
                })
                .collect()
        })
        .collect();
    let dmax = diffs
        .iter()
        .flatten()
        .map(|p| p.1)
        .fold(FLOOR * 10.0, f64::max)
        * 10.0;

    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(HEIGHT * 3 / 5);

    let mut chart = ChartBuilder::on(&top)
        .caption("loss (dots: validation)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("loss")
        .label_style(("sans-serif", 14))
        .draw()?;
    for (i, (run, (loss, val))) in runs.iter().zip(&curves).enumerate() {
        let color = color(i);
        chart
            .draw_series(LineSeries::new(loss.iter().copied(), color.stroke_width(2)))?
            .label(run.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
            });
        chart.draw_series(val.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;

    let mut chart = ChartBuilder::on(&bottom)
        .caption(
            format!(
                "relative loss difference from {} (0 drawn at {FLOOR:e})",
                reference.name
            ),
            ("sans-serif", 16),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, (FLOOR / 2.0..dmax).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("|a - b| / |a|")
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .label_style(("sans-serif", 14))
        .draw()?;
    for (i, d) in diffs.iter().enumerate() {
        let color = color(i + 1);
        chart.draw_series(LineSeries::new(d.iter().copied(), color.stroke_width(2)))?;
        chart.draw_series(d.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    root.present()?;
    Ok(())
}
