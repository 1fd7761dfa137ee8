//! `openapi.yaml` matches the router: every route registered in `src/http/` is described, the document
//! describes no route that does not exist, and every error answer it documents is
//! `application/problem+json` with the `Problem` schema. Reads files only: no database, no server.
//!
//! Routes are found by scanning `src/http/` (where `http::app` assembles the service's router) for
//! `.route("PATH", METHOD(..).METHOD(..))`. Forms the scanner does not understand (`nest`,
//! `route_service`, `any`, a path that is not a literal, …) fail the test with their location, so a
//! new way of registering routes cannot slip past it unnoticed. Other servers in `src/` (test doubles
//! such as the fake notification provider) are not part of the service and are not scanned; nor is the
//! operations console (`src/console/`), whose HTML routes are for browsers, not API clients.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_yaml_ng::Value;

/// OpenAPI's operation keys of a path item (lower case), which are also axum's method-router names.
const METHODS: [&str; 8] = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];

/// Method-router combinators that add behaviour but no method.
const NEUTRAL_COMBINATORS: [&str; 4] = ["layer", "route_layer", "with_state", "handle_error"];

const PROBLEM_JSON: &str = "application/problem+json";
const PROBLEM_SCHEMA: &str = "#/components/schemas/Problem";

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn spec() -> Value {
    let path = manifest_dir().join("openapi.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// `(METHOD, path)`, e.g. `("POST", "/v1/cif/{cif}/confirm")`.
type Operation = (String, String);

/// Every operation the document describes.
fn spec_operations(spec: &Value) -> BTreeSet<Operation> {
    let paths = spec.get("paths").and_then(Value::as_mapping).expect("openapi.yaml has a `paths` mapping");
    let mut operations = BTreeSet::new();
    for (path, item) in paths {
        let path = path.as_str().expect("path keys are strings");
        let item = item.as_mapping().unwrap_or_else(|| panic!("openapi.yaml: path {path} is not a mapping"));
        assert!(!item.contains_key("$ref"), "openapi.yaml: path {path}: a path-level $ref is not supported here");
        for key in item.keys().filter_map(Value::as_str) {
            if METHODS.contains(&key) {
                operations.insert((key.to_uppercase(), path.to_string()));
            }
        }
    }
    operations
}

/// Follows local `$ref`s (`#/components/...`) until a non-reference value.
fn resolve<'a>(spec: &'a Value, value: &'a Value) -> &'a Value {
    let Some(reference) = value.get("$ref").and_then(Value::as_str) else { return value };
    let pointer = reference.strip_prefix("#/").unwrap_or_else(|| panic!("only local $refs are supported: {reference}"));
    let mut target = spec;
    for part in pointer.split('/') {
        let part = part.replace("~1", "/").replace("~0", "~");
        target = target.get(part.as_str()).unwrap_or_else(|| panic!("dangling $ref {reference}"));
    }
    resolve(spec, target)
}

/// A route registration found in the sources.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Registration {
    method: String,
    path: String,
    /// `file:line`, for messages.
    at: String,
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Every route the service's router registers (`src/http/`, recursively).
fn code_routes() -> Vec<Registration> {
    let root = manifest_dir();
    let mut routes = Vec::new();
    for file in rust_files(&root.join("src/http")) {
        let source = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(&root).unwrap_or(&file).display().to_string();
        routes.extend(scan_routes(&source, &name));
    }
    routes
}

/// Blanks comment lines (keeping offsets and line numbers), so doc examples are not taken for routes.
fn without_comment_lines(source: &str) -> String {
    source
        .split_inclusive('\n')
        .map(|line| {
            if line.trim_start().starts_with("//") {
                line.chars().map(|c| if c == '\n' { '\n' } else { ' ' }).collect()
            } else {
                line.to_string()
            }
        })
        .collect()
}

/// Finds the route registrations in one source file. Panics, naming the place, on registrations it
/// cannot read.
fn scan_routes(source: &str, file: &str) -> Vec<Registration> {
    let text = without_comment_lines(source);
    let bytes = text.as_bytes();
    let at = |offset: usize| format!("{file}:{}", text[..offset].matches('\n').count() + 1);
    for unsupported in [".nest(", ".nest_service(", ".route_service("] {
        if let Some(offset) = text.find(unsupported) {
            panic!(
                "{}: `{}` registers routes this test cannot follow; teach tests/it/openapi.rs about it",
                at(offset),
                &unsupported[1..unsupported.len() - 1]
            );
        }
    }
    let mut routes = Vec::new();
    let mut search = 0;
    while let Some(found) = text[search..].find(".route(") {
        let start = search + found;
        let mut i = skip_ws(bytes, start + ".route(".len());
        assert!(bytes.get(i) == Some(&b'"'), "{}: .route(..) path is not a string literal", at(start));
        let end = text[i + 1..].find('"').map(|n| i + 1 + n).expect("unterminated string");
        let path = text[i + 1..end].to_string();
        assert!(!path.contains("{*"), "{}: wildcard route {path} cannot be described in OpenAPI", at(start));
        i = skip_ws(bytes, end + 1);
        assert!(bytes.get(i) == Some(&b','), "{}: expected `,` after the path of .route(..)", at(start));
        i = skip_ws(bytes, i + 1);
        // A chain `get(h).post(h).layer(l)`, each call possibly written `axum::routing::get(h)`.
        loop {
            let name_start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b':') {
                i += 1;
            }
            let name = text[name_start..i].rsplit("::").next().unwrap_or_default();
            i = skip_ws(bytes, i);
            assert!(
                bytes.get(i) == Some(&b'('),
                "{}: cannot read the method router of .route({path:?}, ..)",
                at(start)
            );
            let method = name.strip_suffix("_service").unwrap_or(name);
            if METHODS.contains(&method) {
                routes.push(Registration { method: method.to_uppercase(), path: path.clone(), at: at(start) });
            } else if !NEUTRAL_COMBINATORS.contains(&name) {
                panic!("{}: .route({path:?}, ..) uses `{name}`, which this test does not understand", at(start));
            }
            i = skip_ws(bytes, skip_balanced(bytes, i));
            if bytes.get(i) == Some(&b'.') {
                i = skip_ws(bytes, i + 1);
            } else {
                break;
            }
        }
        if bytes.get(i) == Some(&b',') {
            i = skip_ws(bytes, i + 1);
        }
        assert!(bytes.get(i) == Some(&b')'), "{}: unexpected text after the method router of {path:?}", at(start));
        search = i;
    }
    routes
}

fn skip_ws(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && bytes[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// From an opening `(` at `open`, the index just past its matching `)`; string and char literals are
/// skipped so that parentheses inside them do not count.
fn skip_balanced(bytes: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
            }
            // A char literal such as '(' or '\'' (a lifetime like 'a has no closing quote here).
            b'\'' if bytes.get(i + 2) == Some(&b'\'') => i += 2,
            b'\'' if bytes.get(i + 1) == Some(&b'\\') => {
                i += 2;
                while i < bytes.len() && bytes[i] != b'\'' {
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    panic!("unbalanced parentheses")
}

#[test]
fn the_scanner_reads_the_forms_axum_routes_take() {
    let source = r#"
        // .route("/commented", get(nothing))
        pub fn router() -> Router<AppState> {
            Router::new()
                .route("/a", get(a))
                .route(
                    "/b/{id}",
                    axum::routing::get(|Path(id): Path<String>| async move { format!(")({id}") })
                        .post(b)
                        .layer(ServiceBuilder::new().layer(TimeoutLayer::new(d)))
                        .delete(c),
                )
                .route("/c", post_service(svc)).route("/d", routing::put(h))
        }
    "#;
    let found: Vec<(String, String)> = scan_routes(source, "x.rs").into_iter().map(|r| (r.method, r.path)).collect();
    let expected =
        [("GET", "/a"), ("GET", "/b/{id}"), ("POST", "/b/{id}"), ("DELETE", "/b/{id}"), ("POST", "/c"), ("PUT", "/d")]
            .map(|(m, p)| (m.to_string(), p.to_string()));
    assert_eq!(found, expected);
}

#[test]
#[should_panic(expected = "does not understand")]
fn the_scanner_refuses_method_routers_it_cannot_map() {
    scan_routes(r#"Router::new().route("/x", any(h))"#, "x.rs");
}

#[test]
#[should_panic(expected = "cannot follow")]
fn the_scanner_refuses_nested_routers() {
    scan_routes(r#"Router::new().nest("/v1", inner())"#, "x.rs");
}

#[test]
fn the_scanner_finds_the_service_routes() {
    let routes = code_routes();
    for (method, path) in [("GET", "/healthz"), ("POST", "/v1/cif"), ("POST", "/admin/reclaim")] {
        assert!(
            routes.iter().any(|r| r.method == method && r.path == path),
            "{method} {path} not found in src/http/; found {routes:#?}"
        );
    }
}

#[test]
fn every_registered_route_is_in_the_spec() {
    let described = spec_operations(&spec());
    let missing: Vec<String> = code_routes()
        .into_iter()
        .filter(|r| !described.contains(&(r.method.clone(), r.path.clone())))
        .map(|r| format!("{} {} (registered at {})", r.method, r.path, r.at))
        .collect();
    assert!(missing.is_empty(), "routes missing from openapi.yaml:\n  {}", missing.join("\n  "));
}

#[test]
fn every_spec_operation_is_a_registered_route() {
    let registered: BTreeSet<Operation> = code_routes().into_iter().map(|r| (r.method, r.path)).collect();
    let phantom: Vec<String> = spec_operations(&spec())
        .into_iter()
        .filter(|op| !registered.contains(op))
        .map(|(method, path)| format!("{method} {path}"))
        .collect();
    assert!(
        phantom.is_empty(),
        "openapi.yaml describes routes the code does not register:\n  {}",
        phantom.join("\n  ")
    );
}

#[test]
fn every_error_response_is_problem_json() {
    let spec = spec();
    let mut wrong = Vec::new();
    let mut errors_seen = 0;
    for (method, path) in spec_operations(&spec) {
        let operation = &spec["paths"][path.as_str()][method.to_lowercase().as_str()];
        let responses = operation
            .get("responses")
            .and_then(Value::as_mapping)
            .unwrap_or_else(|| panic!("{method} {path} has no responses"));
        for (status, response) in responses {
            // Unquoted status codes are YAML integers.
            let status = status.as_str().map(str::to_string).or_else(|| status.as_u64().map(|n| n.to_string()));
            let status = status.unwrap_or_else(|| panic!("{method} {path}: response key is not a status"));
            if !(status.starts_with('4') || status.starts_with('5') || status == "default") {
                continue;
            }
            errors_seen += 1;
            let response = resolve(&spec, response);
            let content = response.get("content").and_then(Value::as_mapping);
            let media_types: Vec<&str> =
                content.map(|c| c.keys().filter_map(Value::as_str).collect()).unwrap_or_default();
            if media_types != [PROBLEM_JSON] {
                wrong.push(format!(
                    "{method} {path} {status}: content types {media_types:?}, expected [{PROBLEM_JSON}]"
                ));
                continue;
            }
            let schema = &response["content"][PROBLEM_JSON]["schema"];
            if schema.get("$ref").and_then(Value::as_str) != Some(PROBLEM_SCHEMA) {
                wrong.push(format!("{method} {path} {status}: schema is not {PROBLEM_SCHEMA}"));
            }
        }
    }
    assert!(errors_seen > 0, "openapi.yaml documents no error responses at all");
    assert!(wrong.is_empty(), "error responses that are not problem+json:\n  {}", wrong.join("\n  "));
}
