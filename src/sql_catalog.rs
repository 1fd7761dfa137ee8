//! Every statement the service assembles from parts (claim helpers, state literals, shared `SET`
//! clauses), in the final text Postgres receives, by name: `docs/SQL.md` is this catalog written out,
//! and a test keeps that file current and has Postgres prepare each statement against the migrated
//! schema, so a statement that no longer fits its table fails the suite rather than a request. The
//! statements written out in full where they are used (`sqlx::query("…")`) are read there.

use crate::queue::policy::Strategy;

/// One assembled statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// Where it is built: the module path and the static's name, or the builder and its variant.
    pub name: String,
    /// The text sent to Postgres.
    pub text: String,
}

/// Every assembled statement: the statics of each table's modules, then the claim statement of each
/// worker group of every strategy, with a tenant cap that can bind and without (one entry per
/// distinct text), then the claim locks' statement.
pub fn catalog() -> Vec<Statement> {
    let statics = [
        crate::cif::store::statements(),
        crate::cif::store::hold::statements(),
        crate::cif::reclaim::statements(),
        crate::queue::store::statements(),
        crate::queue::store::sweeps::statements(),
        crate::queue::enqueue::statements(),
        crate::queue::batch::insert::statements(),
        crate::queue::stage::statements(),
        crate::queue::cancel::statements(),
        crate::queue::dlq::statements(),
        crate::queue::stats::statements(),
        crate::queue::analyze::statements(),
    ];
    let mut all: Vec<Statement> = statics
        .concat()
        .into_iter()
        .map(|(name, text)| Statement {
            name: name.trim_start_matches("cifpool::").to_string(),
            text: text.to_string(),
        })
        .collect();
    let mut queue =
        crate::config::Settings::load_with_env(None, std::iter::empty()).expect("the shipped defaults load").queue;
    // Groups of the same order share a text: one entry each, naming every group that runs it.
    let mut claims: Vec<(String, bool, Vec<String>)> = Vec::new();
    for strategy in [Strategy::Fifo, Strategy::Priority, Strategy::Bulkhead, Strategy::FloorBorrow] {
        queue.strategy = strategy;
        for policy in queue.group_policies() {
            for capped in [true, false] {
                // The statement of a full batch, the one a busy group runs; the smaller picks and the
                // catch-up claims of several batches differ only in the number after LIMIT.
                let text = crate::queue::store::claim_sql(&policy, capped, queue.claim_batch, queue.claim_commit());
                let group = format!("{strategy:?} {}", policy.name);
                match claims.iter_mut().find(|(t, _, _)| *t == text) {
                    Some((_, _, groups)) => groups.push(group),
                    None => claims.push((text, capped, vec![group])),
                }
            }
        }
    }
    for (text, capped, groups) in claims {
        let cap = if capped { "a tenant cap can bind" } else { "no tenant cap can bind" };
        all.push(Statement { name: format!("queue::store::claim_sql, {cap}: {}", groups.join(", ")), text });
    }
    // Sent with the BEGIN of a capped claim's transaction, naming the classes whose cap can bind.
    let classes: Vec<&str> = queue.classes.iter().map(|c| c.name.as_str()).collect();
    all.push(Statement {
        name: "queue::store::claim_locks_sql, every shipped class".to_string(),
        text: crate::queue::store::claim_locks_sql(&classes),
    });
    all
}

/// What a session runs before some statements of the catalog: the batch intake's staging table (a
/// temporary table its transaction creates; `ON COMMIT DROP`, so run it in a transaction).
pub fn session_setup() -> Vec<&'static str> {
    vec![crate::queue::batch::insert::CREATE_STAGE]
}

/// The catalog as `docs/SQL.md` holds it.
pub fn render() -> String {
    let mut out = String::from(
        "# The statements cifpool assembles\n\n\
         Generated from the code (`cifpool::sql_catalog::render`); a test fails when this file and the code \
         differ (`CIFPOOL_WRITE_SQL_CATALOG=1 cargo test --test it sql_catalog` rewrites it) and has Postgres \
         prepare every statement against the migrated schema. Statements written out in full where they are \
         used are not repeated here. `$n` are bind parameters.\n",
    );
    for s in catalog() {
        out.push_str(&format!("\n## {}\n\n```sql\n{}\n```\n", s.name, pretty(&s.text)));
    }
    out
}

/// The text with runs of spaces folded and a line break before each main clause, for reading.
fn pretty(text: &str) -> String {
    let folded = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = String::new();
    for (i, word) in folded.split(' ').enumerate() {
        let breaks = [
            "SELECT",
            "FROM",
            "WHERE",
            "UPDATE",
            "SET",
            "RETURNING",
            "WITH",
            "INSERT",
            "DELETE",
            "ORDER",
            "ON",
            "LIMIT",
            "VALUES",
        ];
        if i > 0 && breaks.contains(&word) && !out.ends_with('(') && !out.ends_with(" FOR") {
            out.push('\n');
        } else if i > 0 {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}
