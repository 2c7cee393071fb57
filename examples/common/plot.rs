//! Log-log SVG charts for the tools (`lat_bw --plot`, `conn_scale --plot`),
//! drawn with plotters. Included with `#[path = "common/plot.rs"] mod plot;`
//! by the examples that draw.

use plotters::prelude::*;

/// One line of a chart.
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Line and point colour.
    pub color: RGBColor,
    /// (x, y) points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// What a chart says around its lines.
pub struct Chart<'a> {
    /// Where the SVG goes.
    pub path: &'a str,
    /// Title.
    pub caption: String,
    /// X axis description.
    pub x_desc: &'a str,
    /// Y axis description.
    pub y_desc: &'a str,
    /// How an x tick is written.
    pub x_label: &'a dyn Fn(&f64) -> String,
}

/// Draws `series` on a log2 x axis and a log10 y axis: the tools' x values
/// double per step (sizes, connection counts) and their y values span
/// orders of magnitude.
pub fn draw(chart: &Chart<'_>, series: &[Series]) -> Result<(), String> {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .collect();
    if all.is_empty() {
        return Err("nothing was measured".into());
    }
    let (x_min, x_max) = all.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &(x, _)| {
        (lo.min(x), hi.max(x))
    });
    let (y_min, y_max) = all
        .iter()
        .filter(|&&(_, y)| y > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), &(_, y)| {
            (lo.min(y), hi.max(y))
        });
    if y_min > y_max {
        return Err("every figure is zero".into());
    }
    let root = SVGBackend::new(chart.path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut plot = ChartBuilder::on(&root)
        .caption(&chart.caption, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            ((x_min / 2.0).max(0.5)..x_max * 2.0).log_scale().base(2.0),
            (y_min / 1.5..y_max * 1.5).log_scale(),
        )
        .map_err(|e| e.to_string())?;
    plot.configure_mesh()
        .x_desc(chart.x_desc)
        .y_desc(chart.y_desc)
        .y_label_formatter(&|y| format!("{y:.3}"))
        .x_label_formatter(chart.x_label)
        .draw()
        .map_err(|e| e.to_string())?;
    for line in series {
        let color = line.color;
        plot.draw_series(LineSeries::new(
            line.points.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(|e| e.to_string())?
        .label(line.label.as_str())
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color));
        plot.draw_series(
            line.points
                .iter()
                .map(|&p| Circle::new(p, 3, color.filled())),
        )
        .map_err(|e| e.to_string())?;
    }
    plot.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
