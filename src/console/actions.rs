//! The console's actions. Each takes a CSRF-checked [`Action`] form, calls the service method its
//! `/admin` twin calls (so it leaves the same audit row, with the signed-in key as the actor), leaves a
//! one-line notice and sends the browser back to its page.

use axum::extract::{Path, State};
use axum::response::{Html, Redirect};
use minijinja::value::Serde;
use serde::Deserialize;

use crate::auth::api_key::{KeyError, NewKey};
use crate::cif::CifError;
use crate::cif::refill::RefillOptions;
use crate::console::extract::{Action, ConsoleError, given};
use crate::console::pages::{DeadLetterFilterForm, framed};
use crate::queue::dlq::{DeadLetterAction, Replay};
use crate::queue::pause::PauseKind;
use crate::state::AppState;

/// The Refill button's form.
#[derive(Debug, Deserialize)]
pub struct RefillForm {
    /// Present (a ticked box): add batches even above the watermark.
    #[serde(default)]
    force: Option<String>,
}

/// Refills a pool now (`POST /admin/pools/{name}/refill`).
pub async fn refill(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Action(operator, form): Action<RefillForm>,
) -> Result<Redirect, ConsoleError> {
    let opts = RefillOptions { force: form.force.is_some(), actor: operator.actor.clone() };
    tracing::info!(pool = name, force = opts.force, actor = %operator.actor.name, "console refill");
    let summary = state.cif.refill(&name, opts).await?;
    let notice = format!(
        "Refill of {name}: {}, {} codes added in {} batches ({:.0} ms).",
        summary.outcome.label(),
        summary.codes_added,
        summary.batches,
        summary.duration_ms
    );
    operator.done(&state, &notice, "/console/pools").await
}

/// Returns a pool's expired holds now (`POST /admin/reclaim`, for one pool).
pub async fn reclaim(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Action(operator, _): Action<serde::de::IgnoredAny>,
) -> Result<Redirect, ConsoleError> {
    let summary = state.cif.reclaim(Some(&name), &operator.actor).await?;
    let notice = format!("Reclaim of {name}: {} expired holds returned.", summary.total);
    operator.done(&state, &notice, "/console/pools").await
}

/// The Rotate key form: the new key's id.
#[derive(Debug, Deserialize)]
pub struct RotateKeyForm {
    /// The label the new key is derived with (new to the pool).
    key_id: String,
}

/// Starts a new key epoch for a pool (`POST /admin/pools/{name}/rotate-key`), then refills it.
pub async fn rotate_key(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Action(operator, form): Action<RotateKeyForm>,
) -> Result<Redirect, ConsoleError> {
    let key_id = form.key_id.trim();
    tracing::warn!(pool = name, key_id, actor = %operator.actor.name, "console key rotation");
    let rotation = state.cif.rotate_key(&name, key_id, &operator.actor).await?;
    let r = &rotation.rotated;
    let notice = format!(
        "Key of {name} rotated: epoch {} (key id {}, check {}) encodes from counter {}; {} available codes of \
         earlier keys discarded; the refill added {} codes.",
        r.epoch, r.key_id, r.key_check, r.first_counter, r.available_discarded, rotation.refill.codes_added
    );
    operator.done(&state, &notice, "/console/pools").await
}

/// Pauses or resumes a class or provider (`POST /admin/queue/{classes|providers}/{name}/{pause|resume}`).
pub async fn pause(
    State(state): State<AppState>,
    Path((kind, name, change)): Path<(String, String, String)>,
    Action(operator, _): Action<serde::de::IgnoredAny>,
) -> Result<Redirect, ConsoleError> {
    let kind = match kind.as_str() {
        "classes" => PauseKind::Class,
        "providers" => PauseKind::Provider,
        other => return Err(ConsoleError::NotFound(format!("no queue part named {other:?}"))),
    };
    let paused = match change.as_str() {
        "pause" => true,
        "resume" => false,
        other => return Err(ConsoleError::NotFound(format!("no queue action named {other:?}"))),
    };
    let changed = state
        .notifications
        .set_pause(kind, &name, paused, &operator.actor)
        .await?
        .ok_or_else(|| ConsoleError::NotFound(format!("no {} named {name:?}", kind.as_str())))?;
    let notice = match (changed, paused) {
        (true, true) => format!("Paused {} {name} for every pod.", kind.as_str()),
        (true, false) => format!("Resumed {} {name}.", kind.as_str()),
        (false, true) => format!("{} {name} was already paused.", kind.as_str()),
        (false, false) => format!("{} {name} was not paused.", kind.as_str()),
    };
    operator.done(&state, &notice, "/console/queue").await
}

/// Retries (one more attempt) or discards one dead letter (`POST /admin/dlq/{id}/{retry|discard}`).
pub(crate) async fn dead_letter(
    State(state): State<AppState>,
    Path((id, change)): Path<(String, String)>,
    Action(operator, back): Action<DeadLetterFilterForm>,
) -> Result<Redirect, ConsoleError> {
    let id: i64 = id.parse().map_err(|_| ConsoleError::BadRequest(format!("{id:?} is not a job id")))?;
    let done = match change.as_str() {
        "retry" => state.notifications.retry_dead_letter(id, 1, &operator.actor).await?,
        "discard" => state.notifications.discard_dead_letter(id, &operator.actor).await?,
        other => return Err(ConsoleError::NotFound(format!("no dead-letter action named {other:?}"))),
    };
    let notice = match done {
        DeadLetterAction::Done(_) if change == "retry" => {
            format!("Job {id} is back in the queue with one more attempt.")
        }
        DeadLetterAction::Done(_) => format!("Job {id} discarded."),
        DeadLetterAction::NotDead(status) => {
            return Err(ConsoleError::Conflict(format!("job {id} is {status}, not dead")));
        }
        DeadLetterAction::NotFound => return Err(ConsoleError::NotFound(format!("no job {id}"))),
    };
    operator.done(&state, &notice, &back.back()?).await
}

/// The bulk replay form: a filter, a pace and a ceiling (the preview), or the count confirmed.
#[derive(Debug, Deserialize)]
pub struct ReplayForm {
    #[serde(flatten)]
    filter: DeadLetterFilterForm,
    /// Jobs per second they become due at.
    rate_per_sec: String,
    /// At most this many (the preview's ceiling, then the count the operator confirmed).
    max: String,
}

impl ReplayForm {
    fn replay(&self) -> Result<Replay, ConsoleError> {
        let number = |name: &str, text: &str| -> Result<f64, ConsoleError> {
            text.trim().parse::<f64>().map_err(|_| ConsoleError::BadRequest(format!("{name} must be a number")))
        };
        let max = number("max", &self.max)?;
        if max.fract() != 0.0 {
            return Err(ConsoleError::BadRequest("max must be a whole number".into()));
        }
        let replay = Replay {
            filter: self.filter.filter()?,
            max: max as i64,
            rate_per_sec: number("rate_per_sec", &self.rate_per_sec)?,
            extra_attempts: 1,
        };
        replay.validate().map_err(ConsoleError::BadRequest)?;
        Ok(replay)
    }
}

/// Says how many dead letters a replay would take and how long they take to come due, with the
/// button that does it (nothing changes yet).
pub(crate) async fn replay_preview(
    State(state): State<AppState>,
    Action(operator, form): Action<ReplayForm>,
) -> Result<Result<Html<String>, Redirect>, ConsoleError> {
    let replay = form.replay()?;
    let count = state.notifications.count_dead_letters(&replay.filter, replay.max).await?;
    if count == 0 {
        let back = form.filter.back()?;
        return Ok(Err(operator.done(&state, "No dead letters match that filter: nothing to replay.", &back).await?));
    }
    let body = minijinja::context! {
        count,
        rate => replay.rate_per_sec,
        seconds => (count as f64 / replay.rate_per_sec).ceil(),
        filter => Serde(&replay.filter),
    };
    Ok(Ok(framed(&operator, "replay_confirm.html", "dead_letters", "Confirm replay", body)?))
}

/// Replays the confirmed number of dead letters (`POST /admin/dlq/replay`); jobs that died since the
/// preview are not taken beyond that number.
pub async fn replay(
    State(state): State<AppState>,
    Action(operator, form): Action<ReplayForm>,
) -> Result<Redirect, ConsoleError> {
    let replay = form.replay()?;
    let replayed = state.notifications.replay(&replay, &operator.actor).await?;
    tracing::info!(replayed, filter = ?replay.filter, rate = replay.rate_per_sec, actor = %operator.actor.name,
        "dead letters replayed from the console");
    let notice = format!("Replayed {replayed} dead letters, due at {} per second.", replay.rate_per_sec);
    operator.done(&state, &notice, &form.filter.back()?).await
}

impl From<CifError> for ConsoleError {
    fn from(e: CifError) -> ConsoleError {
        match e {
            CifError::UnknownType { given, .. } => ConsoleError::NotFound(format!("no pool named {given:?}")),
            CifError::Malformed(detail) | CifError::Invalid(detail) => ConsoleError::BadRequest(detail),
            CifError::Conflict(detail) => ConsoleError::Conflict(detail),
            e @ CifError::Halted => ConsoleError::Conflict(e.to_string()),
            CifError::Interrupted(detail) => ConsoleError::Unavailable(detail),
            CifError::Database(e) => e.into(),
        }
    }
}

impl From<KeyError> for ConsoleError {
    fn from(e: KeyError) -> ConsoleError {
        match e {
            KeyError::Invalid(detail) => ConsoleError::BadRequest(detail),
            e @ KeyError::Duplicate(_) => ConsoleError::Conflict(e.to_string()),
            e @ KeyError::NotFound(_) => ConsoleError::NotFound(e.to_string()),
            KeyError::Database(e) => e.into(),
        }
    }
}

/// Creates a key (`POST /admin/keys`) and shows its secret, this once. The form repeats `scope` per
/// ticked box; `tenants` is a comma-separated list (empty: any tenant).
pub async fn create_key(
    State(state): State<AppState>,
    Action(operator, fields): Action<Vec<(String, String)>>,
) -> Result<Html<String>, ConsoleError> {
    let field = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let scopes: Vec<String> = fields.iter().filter(|(k, _)| k == "scope").map(|(_, v)| v.clone()).collect();
    let tenants: Option<Vec<String>> = given(&field("tenants"))
        .map(|list| list.split(',').map(str::trim).filter(|t| !t.is_empty()).map(str::to_string).collect());
    let new = NewKey { name: field("name").unwrap_or_default().trim().to_string(), scopes, tenants };
    let created = state.auth.create_key(&operator.actor, &new).await?;
    tracing::info!(key = %created.name, scopes = ?created.scopes, actor = %operator.actor.name, "API key created from the console");
    framed(&operator, "key_created.html", "keys", "Key created", minijinja::context! { created => Serde(&created) })
}

/// Revokes a key (`DELETE /admin/keys/{name}`); its console sessions end with it.
pub(crate) async fn revoke_key(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Action(operator, _): Action<serde::de::IgnoredAny>,
) -> Result<Redirect, ConsoleError> {
    state.auth.revoke_key(&operator.actor, &name).await?;
    tracing::info!(key = %name, actor = %operator.actor.name, "API key revoked from the console");
    operator.done(&state, &format!("Key {name} revoked."), "/console/keys").await
}
