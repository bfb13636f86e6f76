//! Plain-text tables and number formatting for the terminal.

/// A table printed with aligned columns.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with these column headers (they set the number of columns).
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: vec![],
        }
    }

    /// Appends a row of cells, one per column (cells beyond the header's columns are dropped when
    /// rendered).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as text: the header, a line of dashes under each column, then the rows in
    /// order; columns padded to their widest cell and separated by two spaces, each line ending
    /// in a newline.
    pub fn render(&self) -> String {
        let cols = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(cols) {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        // Padded by hand: a formatting width is at most 65535, and a cell may be longer (a
        // 100,000-digit value given to `cast`). Cells beyond the header's columns are dropped.
        let line = |cells: &[String]| -> String {
            let parts: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(c, &w)| {
                    let pad = w.saturating_sub(c.chars().count());
                    format!("{c}{}", " ".repeat(pad))
                })
                .collect();
            parts.join("  ").trim_end().to_string()
        };
        let mut out = line(&self.header);
        out.push('\n');
        out.push_str(
            &widths
                .iter()
                .map(|w| "-".repeat(*w))
                .collect::<Vec<_>>()
                .join("  "),
        );
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }
}

/// Formats like C's `%g` with `digits` significant digits (torch.finfo prints `%g`, 6 digits).
pub fn g(x: f64, digits: usize) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() {
            "-0".into()
        } else {
            "0".into()
        };
    }
    let exp = x.abs().log10().floor() as i32;
    let sci = format!("{:.*e}", digits.saturating_sub(1), x);
    // Rounding may move the exponent (9.9999996 -> 1.00000e1): take it from the formatted text.
    let (mantissa, e) = sci.split_once('e').unwrap_or((&sci, "0"));
    let e: i32 = e.parse().unwrap_or(exp);
    if e < -4 || e >= digits as i32 {
        let m = trim_zeros(mantissa);
        format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
    } else {
        let decimals = (digits as i32 - 1 - e).max(0) as usize;
        trim_zeros(&format!("{:.*}", decimals, x)).to_string()
    }
}

fn trim_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::{Table, g};

    #[test]
    fn columns_align_by_characters_not_bytes() {
        let mut t = Table::new(&["µs", "x"]);
        t.row(vec!["1".into(), "2".into()]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines, ["µs  x", "--  -", "1   2"]);
    }

    #[test]
    fn g_matches_printf() {
        assert_eq!(g(3.3895313892515355e38, 6), "3.38953e+38");
        assert_eq!(g(6.103515625e-05, 6), "6.10352e-05");
        assert_eq!(g(0.0009765625, 6), "0.000976562");
        assert_eq!(g(448.0, 6), "448");
        assert_eq!(g(0.125, 6), "0.125");
        assert_eq!(g(1.1920928955078125e-07, 6), "1.19209e-07");
        assert_eq!(g(57344.0, 6), "57344");
        assert_eq!(g(9.9999996, 6), "10");
    }

    #[test]
    fn cells_of_any_length_and_rows_of_any_width_render() {
        let long = "1".repeat(100_000);
        let mut t = super::Table::new(&["value", "format"]);
        t.row(vec![long.clone(), "f16".into()]);
        t.row(vec!["2".into(), "bf16".into(), "an extra cell".into()]);
        t.row(vec![]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[2], format!("{long}  f16"));
        assert_eq!(lines[3], format!("2{}  bf16", " ".repeat(99_999)));
        assert!(!text.contains("an extra cell"));
    }
}
