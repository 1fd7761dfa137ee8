//! Pausing a class or a provider for the whole deployment. A pause is a row of `queue_pauses`; every pod
//! reads the table at each budget sync (every 200 ms) and its claims leave out a paused class and every
//! class of a paused provider. Sends already in flight finish; intake goes on accepting.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::audit::{self, Actor, Event};

/// What a pause applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PauseKind {
    /// A message class: no pod claims its jobs.
    Class,
    /// A provider: no pod claims jobs of the classes that send through it.
    Provider,
}

impl PauseKind {
    /// The name in `queue_pauses.kind` and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            PauseKind::Class => "class",
            PauseKind::Provider => "provider",
        }
    }
}

/// The pauses in force, as a pod last read them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pauses {
    classes: BTreeSet<String>,
    providers: BTreeSet<String>,
}

impl Pauses {
    /// Whether jobs of `class`, sent through `provider`, may not be claimed now.
    pub(crate) fn blocks(&self, class: &str, provider: &str) -> bool {
        self.classes.contains(class) || self.providers.contains(provider)
    }

    /// Whether `name` of `kind` is paused.
    pub(crate) fn is_paused(&self, kind: PauseKind, name: &str) -> bool {
        match kind {
            PauseKind::Class => self.classes.contains(name),
            PauseKind::Provider => self.providers.contains(name),
        }
    }

    /// Records a pause or a resume made by this pod at once, ahead of the next read.
    pub fn set(&mut self, kind: PauseKind, name: &str, paused: bool) {
        let set = match kind {
            PauseKind::Class => &mut self.classes,
            PauseKind::Provider => &mut self.providers,
        };
        if paused {
            set.insert(name.to_string());
        } else {
            set.remove(name);
        }
    }
}

/// One pause in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct PauseRow {
    /// `class` or `provider`.
    pub kind: String,
    /// The class's or provider's name.
    pub name: String,
    /// Since when.
    pub paused_at: DateTime<Utc>,
    /// The actor who paused it.
    pub paused_by: String,
}

/// Every pause in force.
pub async fn list(db: &PgPool) -> Result<Vec<PauseRow>, sqlx::Error> {
    sqlx::query_as("SELECT kind, name, paused_at, paused_by FROM queue_pauses ORDER BY kind, name").fetch_all(db).await
}

/// Reads the pauses in force.
pub async fn load(db: &PgPool) -> Result<Pauses, sqlx::Error> {
    let mut pauses = Pauses::default();
    for row in list(db).await? {
        let kind = if row.kind == "class" { PauseKind::Class } else { PauseKind::Provider };
        pauses.set(kind, &row.name, true);
    }
    Ok(pauses)
}

/// Pauses (or, with `paused` false, resumes) `name`, with its audit row; returns whether anything
/// changed (pausing a paused class, or resuming a running one, changes nothing and records nothing).
pub async fn set(db: &PgPool, kind: PauseKind, name: &str, paused: bool, actor: &Actor) -> Result<bool, sqlx::Error> {
    let mut tx = db.begin().await?;
    let changed = if paused {
        sqlx::query("INSERT INTO queue_pauses (kind, name, paused_by) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
            .bind(kind.as_str())
            .bind(name)
            .bind(&actor.name)
            .execute(&mut *tx)
            .await?
    } else {
        sqlx::query("DELETE FROM queue_pauses WHERE kind = $1 AND name = $2")
            .bind(kind.as_str())
            .bind(name)
            .execute(&mut *tx)
            .await?
    }
    .rows_affected()
        > 0;
    if changed {
        let action = if paused { audit::action::QUEUE_PAUSED } else { audit::action::QUEUE_RESUMED };
        let detail = serde_json::json!({ "kind": kind.as_str(), "name": name });
        audit::record(&mut tx, actor, &Event { action, detail: Some(detail), ..Event::default() }).await?;
    }
    tx.commit().await?;
    Ok(changed)
}
