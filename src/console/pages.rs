//! The console's pages. Each reads what its `/admin` twin reads (pool depth, the queue view, dead
//! letters, keys, the audit trail) and renders it with the forms of the actions that apply.

use axum::extract::{Query, RawQuery, State};
use axum::response::Html;
use chrono::{DateTime, NaiveDateTime, Utc};
use minijinja::Value;
use minijinja::value::Serde;
use serde::{Deserialize, Serialize};

use crate::audit::AuditQuery;
use crate::auth::Scope;
use crate::console::extract::{ConsoleError, Operator, given, render};
use crate::queue::dlq::DlqFilter;
use crate::state::AppState;

/// Dead letters listed per page.
pub(crate) const DEAD_LETTERS_SHOWN: i64 = 100;
/// Audit events listed per page.
pub(crate) const AUDIT_SHOWN: i64 = 50;

/// How long ago `at` was, in the unit an operator reads at a glance.
pub fn ago(at: DateTime<Utc>) -> String {
    let ago = (Utc::now() - at).num_seconds().max(0);
    match ago {
        0..60 => format!("{ago} s ago"),
        60..3600 => format!("{} min ago", ago / 60),
        3600..172_800 => format!("{} h ago", ago / 3600),
        _ => format!("{} days ago", ago / 86_400),
    }
}

/// `at` as the console shows times: UTC to the second, with how long ago.
pub fn when(at: Option<DateTime<Utc>>) -> String {
    let Some(at) = at else { return "never".into() };
    format!("{} ({})", at.format("%Y-%m-%d %H:%M:%S UTC"), ago(at))
}

/// Renders `template` in the frame of every signed-in page: `page` is the navigation entry it sits
/// under, and the session gives the operator's name, the CSRF token of its forms and the notice.
pub(crate) fn framed(
    operator: &Operator,
    template: &str,
    page: &str,
    title: &str,
    body: minijinja::Value,
) -> Result<Html<String>, ConsoleError> {
    let frame = minijinja::context! {
        page, title,
        operator => &operator.actor.name,
        csrf => &operator.session.csrf,
        notice => &operator.session.notice,
    };
    render(template, minijinja::context! { ..frame, ..body })
}

/// A navigation entry's own page (template `{page}.html`).
fn page(operator: &Operator, page: &str, title: &str, body: minijinja::Value) -> Result<Html<String>, ConsoleError> {
    framed(operator, &format!("{page}.html"), page, title, body)
}

#[derive(Serialize)]
struct PoolRow {
    name: String,
    available: u64,
    reserved: u64,
    used: u64,
    low_watermark: u64,
    low: bool,
    domain_used_percent: String,
    last_refill_ago: Option<String>,
    last_refill_at: Option<String>,
    last_refill_added: Option<i64>,
    last_reclaim_ago: Option<String>,
    last_reclaim_at: Option<String>,
    last_reclaim_returned: Option<i64>,
    key_epoch: i16,
    key_id: String,
    cipher: &'static str,
}

/// Pools: depth, watermark, how much of the code space is used, last refill and reclaim.
pub async fn pools(operator: Operator, State(state): State<AppState>) -> Result<Html<String>, ConsoleError> {
    let depth = state.cif.pool_stats().await?;
    let upkeep = state.cif.pool_upkeep().await?;
    let rows: Vec<PoolRow> = depth
        .into_iter()
        .map(|s| {
            let u = upkeep.iter().find(|u| u.customer_type == s.customer_type).cloned().unwrap_or_default();
            let keys = state.cif.pools().get(&s.customer_type).map(|pool| pool.keys());
            PoolRow {
                available: s.available,
                reserved: s.reserved,
                used: s.used,
                low_watermark: s.low_watermark,
                low: s.low,
                domain_used_percent: format!("{:.4} %", s.domain_used_fraction * 100.0),
                last_refill_ago: u.last_refill_at.map(ago),
                last_refill_at: u.last_refill_at.map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string()),
                last_refill_added: u.last_refill_added,
                last_reclaim_ago: u.last_reclaim_at.map(ago),
                last_reclaim_at: u.last_reclaim_at.map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string()),
                last_reclaim_returned: u.last_reclaim_returned,
                key_epoch: keys.as_ref().map_or(0, |k| k.current().number),
                key_id: keys.as_ref().map_or_else(String::new, |k| k.current().key_id.clone()),
                cipher: keys.as_ref().map_or("", |k| k.current().codec.permutation().cipher().name()),
                name: s.customer_type,
            }
        })
        .collect();
    page(&operator, "pools", "Pools", minijinja::context! { pools => Serde(rows) })
}

/// Queue: per class and per provider, with pause and resume.
pub async fn queue(operator: Operator, State(state): State<AppState>) -> Result<Html<String>, ConsoleError> {
    let view = state.notifications.view().await?;
    page(
        &operator,
        "queue",
        "Queue",
        minijinja::context! {
            classes => Serde(view.classes), providers => Serde(view.providers), counted_age_s => view.counted_age_s,
        },
    )
}

/// The filter of the Dead letters page as its form sends it: the domain's filter, except that a form
/// sends an empty field for "any".
#[derive(Debug, Default, Deserialize)]
#[serde(transparent)]
pub(crate) struct DeadLetterFilterForm(pub DlqFilter);

impl DeadLetterFilterForm {
    /// The filter the domain takes, checked.
    pub fn filter(&self) -> Result<DlqFilter, ConsoleError> {
        let DlqFilter { class, tenant, error } = &self.0;
        let filter = DlqFilter { class: given(class), tenant: given(tenant), error: given(error) };
        filter.validate().map_err(ConsoleError::BadRequest)?;
        Ok(filter)
    }

    /// The page's query string for this filter (where actions send the browser back to).
    pub fn back(&self) -> Result<String, ConsoleError> {
        let filter = self.filter()?;
        let query = serde_urlencoded::to_string(&filter).unwrap_or_default();
        Ok(if query.is_empty() { "/console/dead-letters".into() } else { format!("/console/dead-letters?{query}") })
    }
}

/// Dead letters: filter, retry or discard one, replay many at a pace.
pub(crate) async fn dead_letters(
    operator: Operator,
    State(state): State<AppState>,
    Query(form): Query<DeadLetterFilterForm>,
) -> Result<Html<String>, ConsoleError> {
    let filter = form.filter()?;
    let jobs: Vec<_> = state
        .notifications
        .dead_letters(&filter, DEAD_LETTERS_SHOWN)
        .await?
        .into_iter()
        .map(|j| minijinja::context! { died => when(j.finished_at), ..Value::from(Serde(&j)) })
        .collect();
    let classes: Vec<&String> = state.notifications.runtime().classes.keys().collect();
    let body = minijinja::context! {
        jobs => Serde(jobs), classes => Serde(classes), filter => Serde(filter), shown => DEAD_LETTERS_SHOWN,
        default_rate => 10, default_max => 1000,
    };
    page(&operator, "dead_letters", "Dead letters", body)
}

/// Keys: every key (never a secret), a form to create one, revoke buttons.
pub async fn keys(operator: Operator, State(state): State<AppState>) -> Result<Html<String>, ConsoleError> {
    let keys: Vec<_> = state
        .auth
        .keys()
        .await?
        .into_iter()
        .map(|k| {
            minijinja::context! {
                created => when(Some(k.created_at)),
                last_used => when(k.last_used_at),
                revoked => k.revoked_at.map(|t| when(Some(t))),
                scope_list => k.scopes.0.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
                tenant_list => k.tenants.as_ref().map(|t| t.join(", ")),
                ..Value::from(Serde(&k))
            }
        })
        .collect();
    let scopes: Vec<&str> = Scope::ALL.iter().map(|s| s.as_str()).collect();
    page(&operator, "keys", "API keys", minijinja::context! { keys => Serde(keys), scopes => Serde(scopes) })
}

/// The Audit page's search form: times as the browser's `datetime-local` sends them (read as UTC) or
/// RFC 3339.
#[derive(Debug, Default, Deserialize, Serialize)]
struct AuditForm {
    #[serde(default)]
    cif: Option<String>,
    #[serde(default)]
    customer_ref: Option<String>,
    #[serde(default)]
    actor: Option<String>,
    #[serde(default)]
    action: Option<String>,
    #[serde(default)]
    since: Option<String>,
    #[serde(default)]
    until: Option<String>,
    #[serde(default)]
    cursor: Option<i64>,
}

/// A time typed into the console: RFC 3339, or `YYYY-MM-DDTHH:MM[:SS]` taken as UTC.
fn time_field(name: &str, value: &Option<String>) -> Result<Option<DateTime<Utc>>, ConsoleError> {
    let Some(text) = given(value) else { return Ok(None) };
    if let Ok(t) = DateTime::parse_from_rfc3339(&text) {
        return Ok(Some(t.with_timezone(&Utc)));
    }
    ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S"]
        .iter()
        .find_map(|f| NaiveDateTime::parse_from_str(&text, f).ok())
        .map(|t| Some(t.and_utc()))
        .ok_or_else(|| ConsoleError::BadRequest(format!("{name}: {text:?} is not a time (e.g. 2026-12-01T09:30, UTC)")))
}

/// Audit: search the trail by code, customer reference, actor, action and time.
pub async fn audit(
    operator: Operator,
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
) -> Result<Html<String>, ConsoleError> {
    let form: AuditForm = serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| ConsoleError::BadRequest(format!("unusable search: {e}")))?;
    let query = AuditQuery {
        cif: given(&form.cif),
        customer_ref: given(&form.customer_ref),
        actor: given(&form.actor),
        action: given(&form.action),
        since: time_field("since", &form.since)?,
        until: time_field("until", &form.until)?,
        cursor: form.cursor,
        limit: Some(AUDIT_SHOWN),
    };
    query.validate().map_err(ConsoleError::BadRequest)?;
    let found = state.audit.search(&query).await?;
    let events: Vec<_> = found
        .events
        .iter()
        .map(|e| {
            minijinja::context! {
                when => e.at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
                detail_text => e.detail.as_ref().map(|d| d.to_string()),
                ..Value::from(Serde(e))
            }
        })
        .collect();
    let older = found.next_cursor.map(|cursor| {
        let next = AuditForm { cursor: Some(cursor), ..form_without_cursor(&form) };
        format!("/console/audit?{}", serde_urlencoded::to_string(&next).unwrap_or_default())
    });
    page(
        &operator,
        "audit",
        "Audit trail",
        minijinja::context! { events => Serde(events), older, search => Serde(form) },
    )
}

fn form_without_cursor(form: &AuditForm) -> AuditForm {
    AuditForm {
        cif: given(&form.cif),
        customer_ref: given(&form.customer_ref),
        actor: given(&form.actor),
        action: given(&form.action),
        since: given(&form.since),
        until: given(&form.until),
        cursor: None,
    }
}
