//! `sim.png`: OTP latency over OTP creation time, one panel per scenario, one line per strategy.
//!
//! Text is drawn with an embedded DejaVu Sans (`assets/fonts/`), registered with plotters' `ab_glyph`
//! backend, so the chart renders the same on a machine without any system font or fontconfig.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context as _, anyhow};
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::sim::{DEADLINE_S, SimResult, SimScenario};
use cifpool::queue::policy::Strategy;

/// DejaVu Sans (Bitstream Vera license, see `assets/fonts/README.md`).
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
/// The family name the embedded font is registered under.
const FAMILY: &str = "sans-serif";

/// Register the embedded font once per process.
fn register_font() -> anyhow::Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok()
            && plotters::style::register_font(FAMILY, FontStyle::Bold, FONT).is_ok()
    });
    if ok { Ok(()) } else { Err(anyhow!("embedded font DejaVuSans.ttf is not a valid font")) }
}

fn colour(s: Strategy) -> RGBColor {
    match s {
        Strategy::Fifo => RGBColor(110, 110, 110),
        Strategy::Priority => RGBColor(230, 120, 0),
        Strategy::Bulkhead => RGBColor(30, 90, 210),
        Strategy::FloorBorrow => RGBColor(20, 155, 60),
    }
}

/// Line width: strategies drawn earlier are wider, so where two lines coincide (B and C at 0.15 s,
/// A and C under a slow SMS) both stay visible as nested stripes.
fn width(s: Strategy) -> u32 {
    match s {
        Strategy::Fifo => 3,
        Strategy::Priority => 8,
        Strategy::Bulkhead => 6,
        Strategy::FloorBorrow => 3,
    }
}

fn label(s: Strategy) -> &'static str {
    match s {
        Strategy::Fifo => "FIFO",
        Strategy::Priority => "A priority",
        Strategy::Bulkhead => "B bulkhead",
        Strategy::FloorBorrow => "C floor+borrow",
    }
}

fn fmt_latency(v: f64) -> String {
    if v < 0.1 {
        format!("{:.0} ms", v * 1000.0)
    } else if v >= 100.0 {
        format!("{v:.0} s")
    } else if v >= 10.0 {
        format!("{v:.1} s")
    } else {
        format!("{v:.2} s")
    }
}

fn fmt_tick(v: f64) -> String {
    if v >= 1.0 { format!("{v:.0}") } else { format!("{v}") }
}

/// Width of the legend column right of each panel's chart, pixels.
const LEGEND_W: u32 = 320;
/// Width of each panel's chart, pixels.
const CHART_W: u32 = 820;

/// One legend line: a line sample (dashed or not) and its text.
struct LegendEntry {
    colour: RGBColor,
    dashed: bool,
    text: String,
}

/// Draw `entries` top-down in `area`, under a small heading.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    entries: &[LegendEntry],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    area.draw(&Text::new("OTP latency", (8, 52), (FAMILY, 19).into_font().style(FontStyle::Bold)))?;
    for (i, e) in entries.iter().enumerate() {
        let y = 92 + 34 * i as i32;
        let style = e.colour.stroke_width(4);
        if e.dashed {
            for k in 0..3 {
                let x = 8 + 12 * k;
                area.draw(&PathElement::new(vec![(x, y), (x + 7, y)], style))?;
            }
        } else {
            area.draw(&PathElement::new(vec![(8, y), (38, y)], style))?;
        }
        area.draw(&Text::new(e.text.clone(), (48, y - 10), (FAMILY, 18).into_font()))?;
    }
    Ok(())
}

/// Write `dir/sim.png` (creating `dir`): one panel per scenario present in `results` (in
/// [`SimScenario::ALL`] order), each with one line per strategy, the 15 s deadline dashed. Returns the
/// file's path.
///
/// Each strategy is drawn as the worst latency of the OTPs created in each `window / 120` slice of
/// creation time (solid line) over a light band from the best to the worst; OTPs still unsent at the
/// horizon are drawn dashed at `horizon − created`, a lower bound of their wait.
pub fn write_png(dir: &Path, results: &[SimResult]) -> anyhow::Result<PathBuf> {
    register_font()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("sim.png");
    let scenarios: Vec<SimScenario> =
        SimScenario::ALL.into_iter().filter(|sc| results.iter().any(|r| r.row.scenario == *sc)).collect();
    anyhow::ensure!(!scenarios.is_empty(), "no simulation results to plot");
    let opts = &results[0].options;

    // Shared axes, so panels compare at a glance.
    let x0 = opts.otp_start_s;
    let x1 = opts.otp_start_s + opts.otp_window_s.max(1e-3);
    let bin_s = (x1 - x0) / 120.0;
    let y_hi = results
        .iter()
        .flat_map(|r| r.curve(0).into_iter().chain(r.unserved_curve(0)).map(|p| p.1))
        .fold(DEADLINE_S, f64::max);
    let y_hi = 10f64.powf((y_hi * 1.5).log10().ceil());
    let y_lo = 0.1f64;

    let cols = if scenarios.len() > 1 { 2 } else { 1 };
    let rows = scenarios.len().div_ceil(cols);
    let (w, h) = ((CHART_W + LEGEND_W) * cols as u32, 130 + 600 * rows as u32);
    {
        let root = BitMapBackend::new(&path, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let (head, body) = root.split_vertically(130);
        head.draw(&Text::new(
            "How long a user waits for an OTP SMS while a 500,000-job promo batch drains",
            (30, 16),
            (FAMILY, 34).into_font().style(FontStyle::Bold).color(&BLACK),
        ))?;
        let grey = RGBColor(70, 70, 70);
        head.draw(&Text::new(
            format!(
                "Simulation: {} workers ({} reserved for OTP in B and C); {} promo jobs inserted at t = 0; OTPs at {}/s \
                 from t = {} s for {} s; run stops at t = {} s.",
                opts.workers,
                opts.reserved,
                opts.promo,
                opts.otp_rate,
                opts.otp_start_s,
                opts.otp_window_s,
                opts.horizon_s
            ),
            (30, 64),
            (FAMILY, 20).into_font().color(&grey),
        ))?;
        head.draw(&Text::new(
            format!(
                "Latency = SMS delivered − OTP created. Line: worst OTP of each {:.2} s of arrivals; band: best to worst. \
                 Dashed: not sent by the end (waited at least this long). \
                 Coinciding lines nest.",
                bin_s
            ),
            (30, 94),
            (FAMILY, 20).into_font().color(&grey),
        ))?;
        let panels = body.split_evenly((rows, cols));
        for (panel, &scenario) in panels.iter().zip(&scenarios) {
            let (chart_area, legend_area) = panel.split_horizontally(CHART_W);
            let chart_area = chart_area.margin(10, 20, 20, 10);
            let mut chart = ChartBuilder::on(&chart_area)
                .caption(
                    format!("{} — {}", scenario.name(), scenario.describe(opts)),
                    (FAMILY, 22).into_font().style(FontStyle::Bold),
                )
                .x_label_area_size(50)
                .y_label_area_size(75)
                .build_cartesian_2d(x0..x1, (y_lo..y_hi).log_scale())?;
            chart
                .configure_mesh()
                .x_desc("OTP created (s after the promo batch)")
                .y_desc("OTP latency (s, log scale)")
                .axis_desc_style((FAMILY, 18))
                .label_style((FAMILY, 16))
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_label_formatter(&|v| fmt_tick(*v))
                .light_line_style(RGBColor(238, 238, 238))
                .bold_line_style(RGBColor(205, 205, 205))
                .draw()?;

            let red = RGBColor(210, 30, 30);
            let mut legend =
                vec![LegendEntry { colour: red, dashed: true, text: format!("{DEADLINE_S:.0} s deadline") }];
            chart.draw_series(DashedLineSeries::new(
                vec![(x0, DEADLINE_S), (x1, DEADLINE_S)],
                12,
                8,
                red.stroke_width(2),
            ))?;

            for r in results.iter().filter(|r| r.row.scenario == scenario) {
                let c = colour(r.row.strategy);
                let env = r.envelope(bin_s);
                if !env.is_empty() {
                    let band: Vec<(f64, f64)> = env
                        .iter()
                        .map(|&(x, _, hi)| (x, hi))
                        .chain(env.iter().rev().map(|&(x, lo, _)| (x, lo)))
                        .collect();
                    chart.draw_series(std::iter::once(Polygon::new(band, c.mix(0.18).filled())))?;
                    let line = c.stroke_width(width(r.row.strategy));
                    chart.draw_series(LineSeries::new(env.iter().map(|&(x, _, hi)| (x, hi)), line))?;
                }
                let unserved = r.unserved_curve(0);
                if !unserved.is_empty() {
                    chart.draw_series(DashedLineSeries::new(unserved.clone(), 6, 6, c.stroke_width(3)))?;
                }
                let text = match r.row.max_s {
                    Some(max) if unserved.is_empty() => format!("{}: max {}", label(r.row.strategy), fmt_latency(max)),
                    Some(max) => {
                        format!("{}: max {} ({} unsent)", label(r.row.strategy), fmt_latency(max), unserved.len())
                    }
                    None => format!("{}: none sent in {} s", label(r.row.strategy), r.options.horizon_s),
                };
                legend.push(LegendEntry { colour: c, dashed: r.row.max_s.is_none(), text });
            }
            draw_legend(&legend_area, &legend)?;
        }
        root.present().with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(path)
}

/// Write `dir/lab.png`: for each lab scenario a panel of OTP wait (`picked_at − created_at`, log
/// scale) over OTP creation time, one line per strategy; OTPs not picked by the end of the run are
/// drawn dashed at `run end − created`, a lower bound of their wait. Returns the file's path.
pub fn write_lab_png(dir: &Path, cells: &[super::real::LabCell], run_s: f64) -> anyhow::Result<PathBuf> {
    use super::real::LabScenario;
    register_font()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("lab.png");
    let scenarios: Vec<LabScenario> =
        LabScenario::ALL.into_iter().filter(|sc| cells.iter().any(|c| c.scenario == *sc)).collect();
    anyhow::ensure!(!scenarios.is_empty(), "no lab results to plot");
    let x0 = cells.iter().flat_map(|c| c.otps.iter().map(|o| o.created_s)).fold(f64::MAX, f64::min).floor();
    let x1 = cells.iter().flat_map(|c| c.otps.iter().map(|o| o.created_s)).fold(0.0, f64::max).ceil().max(x0 + 1.0);
    let y_hi = 10f64.powf((run_s.max(DEADLINE_S) * 1.5).log10().ceil());
    let y_lo = 0.001f64;
    let (w, h) = ((CHART_W + LEGEND_W) * scenarios.len() as u32, 100 + 600);
    {
        let root = BitMapBackend::new(&path, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let (head, body) = root.split_vertically(100);
        head.draw(&Text::new(
            "Lab (real queue): OTP wait while a promo batch drains",
            (30, 16),
            (FAMILY, 28).into_font().style(FontStyle::Bold).color(&BLACK),
        ))?;
        head.draw(&Text::new(
            "Wait = picked_at − created_at from the jobs table. Dashed: not picked before the run ended (waited at \
             least this long).",
            (30, 62),
            (FAMILY, 20).into_font().color(&RGBColor(70, 70, 70)),
        ))?;
        let panels = body.split_evenly((1, scenarios.len()));
        for (panel, &scenario) in panels.iter().zip(&scenarios) {
            let (chart_area, legend_area) = panel.split_horizontally(CHART_W);
            let chart_area = chart_area.margin(10, 20, 20, 10);
            let mut chart = ChartBuilder::on(&chart_area)
                .caption(scenario.name(), (FAMILY, 22).into_font().style(FontStyle::Bold))
                .x_label_area_size(50)
                .y_label_area_size(75)
                .build_cartesian_2d(x0..x1, (y_lo..y_hi).log_scale())?;
            chart
                .configure_mesh()
                .x_desc("OTP created (s after the run started)")
                .y_desc("OTP wait (s, log scale)")
                .axis_desc_style((FAMILY, 18))
                .label_style((FAMILY, 16))
                .y_label_formatter(&|v| fmt_tick(*v))
                .light_line_style(RGBColor(238, 238, 238))
                .bold_line_style(RGBColor(205, 205, 205))
                .draw()?;
            let red = RGBColor(210, 30, 30);
            chart.draw_series(DashedLineSeries::new(
                vec![(x0, DEADLINE_S), (x1, DEADLINE_S)],
                12,
                8,
                red.stroke_width(2),
            ))?;
            let mut legend =
                vec![LegendEntry { colour: red, dashed: true, text: format!("{DEADLINE_S:.0} s OTP deadline") }];
            for cell in cells.iter().filter(|c| c.scenario == scenario) {
                let c = colour(cell.strategy);
                let served: Vec<(f64, f64)> =
                    cell.otps.iter().filter_map(|o| o.wait_s.map(|w| (o.created_s, w.max(y_lo)))).collect();
                let unserved: Vec<(f64, f64)> = cell
                    .otps
                    .iter()
                    .filter(|o| o.wait_s.is_none())
                    .map(|o| (o.created_s, (run_s - o.created_s).max(y_lo)))
                    .collect();
                if !served.is_empty() {
                    chart.draw_series(LineSeries::new(served, c.stroke_width(width(cell.strategy))))?;
                }
                if !unserved.is_empty() {
                    chart.draw_series(DashedLineSeries::new(unserved.clone(), 6, 6, c.stroke_width(3)))?;
                }
                let text = match cell.max_s() {
                    Some(max) if unserved.is_empty() => format!("{}: max {}", label(cell.strategy), fmt_latency(max)),
                    Some(max) => {
                        format!("{}: max {}; {} left", label(cell.strategy), fmt_latency(max), unserved.len())
                    }
                    None => format!("{}: no OTP picked", label(cell.strategy)),
                };
                legend.push(LegendEntry { colour: c, dashed: cell.max_s().is_none(), text });
            }
            draw_legend(&legend_area, &legend)?;
        }
        root.present().with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(path)
}
