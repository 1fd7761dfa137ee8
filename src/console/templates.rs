//! The console's HTML and stylesheet, compiled into the binary (no files to ship, nothing fetched from
//! elsewhere) and rendered by minijinja, which escapes every value in an `.html` template.

use std::sync::LazyLock;

use minijinja::Environment;

/// The stylesheet every page links.
pub(crate) const STYLESHEET: &str = include_str!("templates/console.css");

/// Every template by name.
const TEMPLATES: &[(&str, &str)] = &[
    ("base.html", include_str!("templates/base.html")),
    ("macros.html", include_str!("templates/macros.html")),
    ("error.html", include_str!("templates/error.html")),
    ("sign_in.html", include_str!("templates/sign_in.html")),
    ("pools.html", include_str!("templates/pools.html")),
    ("queue.html", include_str!("templates/queue.html")),
    ("dead_letters.html", include_str!("templates/dead_letters.html")),
    ("replay_confirm.html", include_str!("templates/replay_confirm.html")),
    ("keys.html", include_str!("templates/keys.html")),
    ("key_created.html", include_str!("templates/key_created.html")),
    ("audit.html", include_str!("templates/audit.html")),
];

/// The environment, built once. A template that does not parse is skipped here and named in the log
/// and in the render error; the unit test below keeps that from ever shipping.
static ENVIRONMENT: LazyLock<Environment<'static>> = LazyLock::new(|| {
    let mut env = Environment::new();
    // Undefined values are errors (outside `if` tests), not empty strings: a renamed field fails the
    // handler tests instead of drawing an empty column.
    env.set_undefined_behavior(minijinja::UndefinedBehavior::SemiStrict);
    for (name, source) in TEMPLATES {
        if let Err(e) = env.add_template(name, source) {
            tracing::error!(template = name, error = %e, "console template does not parse");
        }
    }
    env
});

/// Renders template `name` with `context`.
pub fn render(name: &str, context: minijinja::Value) -> Result<String, minijinja::Error> {
    ENVIRONMENT.get_template(name)?.render(context)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_template_parses() {
        let mut env = Environment::new();
        for (name, source) in TEMPLATES {
            env.add_template(name, source).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        }
    }

    #[test]
    fn values_are_escaped() {
        let html = render("sign_in.html", minijinja::context! { title => "x", problem => "<script>" }).unwrap();
        assert!(html.contains("&lt;script&gt;") && !html.contains("<script>"), "{html}");
    }
}
