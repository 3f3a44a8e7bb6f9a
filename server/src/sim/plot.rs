//! SVG charts of a run or a sweep with `plotters` (SVG backend only, no system fonts: text is
//! left to the SVG viewer). Two panels: test accuracy against training samples and against
//! simulated seconds, with a red line at 95%.

use super::row::Row;
use plotters::prelude::*;

/// (samples, simulated seconds, accuracy)
type Point = (f64, f64, f64);

/// One line on a chart.
#[derive(Debug, Clone)]
pub struct Series {
    label: String,
    points: Vec<Point>,
}

impl Series {
    /// The accuracy curve of `rows`.
    pub fn of(label: &str, rows: &[Row]) -> Self {
        Self {
            label: label.to_string(),
            points: rows
                .iter()
                .map(|r| (r.samples as f64, r.sim_time_s, r.test_accuracy))
                .collect(),
        }
    }
}

/// Okabe-Ito colours (distinguishable with colour-blindness), then black.
const COLOURS: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
];

/// Cuts a polyline into the pieces that lie at or above `ymin` (interpolating the crossings),
/// so that the early, low-accuracy part of a curve is clipped at the bottom of the chart
/// instead of being drawn over the axis.
fn clip_below(points: &[(f64, f64)], ymin: f64) -> Vec<Vec<(f64, f64)>> {
    let mut pieces = Vec::new();
    let mut cur: Vec<(f64, f64)> = Vec::new();
    for w in points.windows(2) {
        let ((x0, y0), (x1, y1)) = (w[0], w[1]);
        let cross = |y: f64| x0 + (x1 - x0) * (y - y0) / (y1 - y0);
        match (y0 >= ymin, y1 >= ymin) {
            (true, true) => {
                if cur.is_empty() {
                    cur.push((x0, y0));
                }
                cur.push((x1, y1));
            }
            (true, false) => {
                if cur.is_empty() {
                    cur.push((x0, y0));
                }
                cur.push((cross(ymin), ymin));
                pieces.push(std::mem::take(&mut cur));
            }
            (false, true) => {
                cur.push((cross(ymin), ymin));
                cur.push((x1, y1));
            }
            (false, false) => {}
        }
    }
    if points.len() == 1 && points[0].1 >= ymin {
        cur.push(points[0]);
    }
    if !cur.is_empty() {
        pieces.push(cur);
    }
    pieces
}

/// The lower end of the accuracy axis: 80%, or lower when a curve ends below it.
fn y_floor(series: &[Series]) -> f64 {
    let worst_late = series
        .iter()
        .filter_map(|s| {
            let n = s.points.len();
            s.points[n / 2..].iter().map(|p| p.2).reduce(f64::min)
        })
        .fold(1.0, f64::min);
    if worst_late >= 0.8 {
        0.8
    } else {
        ((worst_late * 10.0).floor() / 10.0 - 0.1).max(0.0)
    }
}

/// Renders the two-panel accuracy chart of `series` as an SVG document.
pub fn accuracy_svg(title: &str, series: &[Series]) -> String {
    let mut svg = String::new();
    // Errors from the SVG backend only come from writing into the String, which cannot fail;
    // a failed chart is an empty document rather than a failed run.
    let _ = draw(&mut svg, title, series);
    svg
}

fn draw<'a>(
    svg: &'a mut String,
    title: &str,
    series: &[Series],
) -> Result<(), Box<dyn std::error::Error + 'a>> {
    let root = SVGBackend::with_string(svg, (1200, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 24))?;
    let panels = root.split_evenly((1, 2));
    let ymin = y_floor(series);
    let max = |f: fn(&Point) -> f64| {
        series
            .iter()
            .flat_map(|s| s.points.iter().map(f))
            .fold(0.0, f64::max)
            .max(1e-9)
    };
    let samples: fn(&Point) -> f64 = |p| p.0;
    let seconds: fn(&Point) -> f64 = |p| p.1;
    let axes = [
        ("training samples", max(samples), samples),
        ("simulated seconds", max(seconds), seconds),
    ];
    for (panel, (xdesc, xmax, x)) in panels.iter().zip(axes) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("test accuracy vs {xdesc}"), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..xmax * 1.02, ymin..1.0)?;
        chart
            .configure_mesh()
            .x_desc(xdesc)
            .y_desc("test accuracy")
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 16))
            .y_label_formatter(&|v| format!("{:.0}%", v * 100.0))
            .x_label_formatter(&|v| {
                if xmax >= 10_000.0 {
                    format!("{:.0}k", v / 1000.0)
                } else {
                    format!("{v:.0}")
                }
            })
            .max_light_lines(0)
            .draw()?;
        // The 95% target, solid rather than dashed: a dashed series is one SVG element per dash.
        chart.draw_series(LineSeries::new(
            [(0.0, 0.95), (xmax * 1.02, 0.95)],
            RGBColor(200, 40, 40).mix(0.6).stroke_width(1),
        ))?;
        for (i, s) in series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let pts: Vec<(f64, f64)> = s.points.iter().map(|p| (x(p), p.2)).collect();
            let mut first = true;
            for piece in clip_below(&pts, ymin) {
                let drawn = chart.draw_series(LineSeries::new(piece, colour.stroke_width(2)))?;
                if std::mem::take(&mut first) {
                    drawn.label(s.label.clone()).legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
                    });
                }
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font(("sans-serif", 16))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_keeps_the_part_above_the_floor() {
        let p = [(0.0, 0.1), (1.0, 0.9), (2.0, 0.95), (3.0, 0.7), (4.0, 0.9)];
        let pieces = clip_below(&p, 0.8);
        assert_eq!(pieces.len(), 2);
        assert!((pieces[0][0].0 - 0.875).abs() < 1e-9, "{pieces:?}");
        assert_eq!(pieces[0][1], (1.0, 0.9));
        assert_eq!(pieces[1].last(), Some(&(4.0, 0.9)));
        assert!(pieces.iter().flatten().all(|&(_, y)| y >= 0.8));
    }

    #[test]
    fn renders_an_svg_with_labels() {
        let rows: Vec<Row> = (0..5)
            .map(|i| Row {
                samples: i * 1000,
                sim_time_s: i as f64,
                test_loss: 1.0,
                test_accuracy: 0.5 + 0.1 * i as f64,
                eval_examples: 100,
                mean_staleness: 0.0,
                max_staleness: 0,
                updates: i,
                accepted: i,
                rejected: 0,
                sybil_accepted: 0,
                sybil_rejected: 0,
                norm_reference: 0.0,
                workers_online: 1,
            })
            .collect();
        let svg = accuracy_svg(
            "t",
            &[Series::of("async", &rows), Series::of("ssp:2", &rows)],
        );
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        assert!(svg.contains("async") && svg.contains("ssp:2"));
        assert!(svg.contains("95%") || svg.contains("90%"));
    }
}
