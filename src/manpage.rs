//! larder.toml(5): the config reference (docs/config.md, compiled in) as a manual page, so the
//! page and the reference a test checks against the config structs are one text. The pages of
//! the commands come from their `--help` definitions (clap_mangen, in the binaries).

/// docs/config.md.
pub const CONFIG_MD: &str = include_str!("../docs/config.md");

/// `md` (docs/config.md's Markdown: headings, paragraphs, lists, code blocks and tables of
/// key, type, default and meaning) as roff for man(7).
pub fn config_page(md: &str, version: &str) -> String {
    let mut out = format!(
        ".TH LARDER.TOML 5 \"\" \"larder {version}\" \"larder\"\n.SH NAME\nlarder.toml \\- \
         configuration of larderd, the larder daemon\n.SH SYNOPSIS\n/etc/larder/larder.toml\n"
    );
    let mut in_code = false;
    let mut paragraph = false;
    for line in md.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            out.push_str(if in_code { ".PP\n.nf\n" } else { ".fi\n" });
            paragraph = false;
            continue;
        }
        if in_code {
            out.push_str(&escape_line(line));
            out.push('\n');
            continue;
        }
        if line.starts_with("# ") {
            out.push_str(".SH DESCRIPTION\n");
            paragraph = false;
        } else if let Some(h) = line.strip_prefix("## ") {
            out.push_str(&format!(".SH \"{}\"\n", inline(h).to_uppercase()));
            paragraph = false;
        } else if let Some(h) = line.strip_prefix("### ") {
            out.push_str(&format!(".SS \"{}\"\n", inline(h)));
            paragraph = false;
        } else if line.starts_with('|') {
            let cells: Vec<&str> = line.trim().trim_matches('|').split(" | ").collect();
            let header = cells.first().is_some_and(|c| c.trim() == "key");
            let rule = line
                .trim()
                .chars()
                .all(|c| matches!(c, '|' | '-' | ':' | ' '));
            if header || rule {
                continue;
            }
            let cell = |i: usize| cells.get(i).map_or("", |c| c.trim());
            out.push_str(&format!(
                ".TP\n{} ({}; default {})\n{}\n",
                escape_line(&inline(cell(0))),
                inline(cell(1)),
                inline(cell(2)),
                escape_line(&inline(cell(3)))
            ));
            paragraph = false;
        } else if line.trim().is_empty() {
            paragraph = false;
        } else {
            if let Some(item) = line.strip_prefix("- ") {
                out.push_str(".IP \\(bu 2\n");
                out.push_str(&escape_line(&inline(item)));
            } else {
                if !paragraph {
                    out.push_str(".PP\n");
                }
                out.push_str(&escape_line(&inline(line.trim_start())));
            }
            out.push('\n');
            paragraph = true;
        }
    }
    out.push_str(".SH SEE ALSO\nlarderd(8), larder(1)\n");
    out
}

/// Inline Markdown as roff: `code` and **strong** bold, [text](link) as its text.
fn inline(s: &str) -> String {
    let s = s.replace('\\', "\\e");
    let mut out = String::with_capacity(s.len());
    let mut rest = s.as_str();
    let mut bold = false;
    while let Some(c) = rest.chars().next() {
        if rest.starts_with("**") || c == '`' {
            out.push_str(if bold { "\\fR" } else { "\\fB" });
            bold = !bold;
            rest = &rest[if c == '`' { 1 } else { 2 }..];
        } else if c == '[' {
            // [text](link) keeps its text.
            match (rest.find("]("), rest.find(')')) {
                (Some(close), Some(end)) if close < end => {
                    out.push_str(&rest[1..close]);
                    rest = &rest[end + 1..];
                }
                _ => {
                    out.push('[');
                    rest = &rest[1..];
                }
            }
        } else {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    if bold {
        out.push_str("\\fR");
    }
    out.replace('—', "\\(em").replace('-', "\\-")
}

/// A line roff takes as text: one starting with `.` or `'` would be a request.
fn escape_line(s: &str) -> String {
    if s.starts_with('.') || s.starts_with('\'') {
        format!("\\&{s}")
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_the_reference_is_an_entry_of_the_page() {
        let page = config_page(CONFIG_MD, "0");
        let keys: Vec<&str> = CONFIG_MD
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
            .collect();
        assert!(keys.len() > 50, "{}", keys.len());
        for key in keys {
            let entry = format!(".TP\n\\fB{}\\fR (", key.replace('-', "\\-"));
            assert!(page.contains(&entry), "{key}");
        }
        assert!(page.starts_with(".TH LARDER.TOML 5"));
        assert!(!page.contains('`') && !page.contains("**") && !page.contains("|\\-"));
    }
}
