//! The queue as one instance runs it: classes with their providers and limits, and the worker groups
//! of the configured strategy.

use std::collections::BTreeMap;
use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::Notify;

use uuid::Uuid;

use crate::config::{ClassSettings, QueueSettings};
use crate::queue::budget;
use crate::queue::pause::{self, PauseKind, Pauses};
use crate::queue::policy::GroupPolicy;
use crate::queue::provider::{ProviderHandle, build_providers};

/// A class as workers see it: its configuration and the provider (with its limit) it sends through.
pub struct ClassRuntime {
    /// Priority, attempts, deadline, backoff, intake target, tenant cap.
    pub settings: ClassSettings,
    /// Shared with every other class configured on the same provider, so they share its limit.
    pub provider: Arc<ProviderHandle>,
}

/// Classes, providers and settings shared by every group of an instance.
pub struct QueueRuntime {
    /// The `[queue]` section this runtime was built from.
    pub settings: QueueSettings,
    /// Classes by name (a `BTreeMap`, so metrics and listings come out sorted).
    pub classes: BTreeMap<String, ClassRuntime>,
    /// Providers by name, each with its adaptive concurrency limit.
    pub providers: BTreeMap<String, Arc<ProviderHandle>>,
    /// Wakes idle claimers when the LISTEN relay hears of new jobs.
    pub wake: Notify,
    /// Wakes the budget task for an early sync: a claim stopped at a provider whose share could grow.
    pub share_wanted: Notify,
    /// This instance's identity among the pods sharing the provider budgets (new at every start).
    pub member: Uuid,
    /// The pauses in force, as last read from `queue_pauses`.
    pauses: std::sync::RwLock<Pauses>,
    /// One permit per batch request this instance may receive at once (`max_concurrent_batches`).
    pub batch_permits: Arc<tokio::sync::Semaphore>,
    /// Seals recipients and payloads at intake and opens them after a claim.
    pub seal: crate::queue::seal::Seal,
    /// Where each priority's due front last stood, for fair keys.
    pub(crate) due_fronts: crate::queue::enqueue::DueFronts,
}

impl QueueRuntime {
    /// Builds providers and classes from settings; jobs' personal data goes through `seal`.
    pub fn new(settings: QueueSettings, seal: crate::queue::seal::Seal) -> Arc<QueueRuntime> {
        let providers = build_providers(&settings.providers);
        Self::with_providers(settings, providers, seal)
    }

    /// Like [`QueueRuntime::new`] with given providers (tests, the lab).
    pub(crate) fn with_providers(
        settings: QueueSettings,
        providers: BTreeMap<String, Arc<ProviderHandle>>,
        seal: crate::queue::seal::Seal,
    ) -> Arc<QueueRuntime> {
        let classes = settings
            .classes
            .iter()
            .map(|c| {
                let provider = providers.get(&c.provider).expect("validated: class provider exists").clone();
                (c.name.clone(), ClassRuntime { settings: c.clone(), provider })
            })
            .collect();
        let batch_permits = Arc::new(tokio::sync::Semaphore::new(settings.max_concurrent_batches));
        Arc::new(QueueRuntime {
            batch_permits,
            settings,
            classes,
            providers,
            wake: Notify::new(),
            share_wanted: Notify::new(),
            member: Uuid::new_v4(),
            pauses: Default::default(),
            seal,
            due_fronts: Default::default(),
        })
    }

    /// The groups to run (see [`QueueSettings::group_policies`]).
    pub fn group_policies(&self) -> Vec<GroupPolicy> {
        self.settings.group_policies()
    }

    /// Workers of this instance that may send through `provider` (0 with the workers off): the most of
    /// its budget this pod could use.
    pub(crate) fn potential(&self, provider: &str) -> u32 {
        if !self.settings.workers_enabled {
            return 0;
        }
        let sends_through = |g: &GroupPolicy| {
            g.classes.iter().any(|c| self.classes.get(c).is_some_and(|c| c.provider.name == provider))
        };
        self.group_policies().iter().filter(|g| sends_through(g)).map(|g| g.size as u32).sum()
    }

    /// The pauses in force, as this pod last read them.
    pub fn pauses(&self) -> Pauses {
        self.pauses.read().expect("pauses lock").clone()
    }

    /// Whether jobs of `class` may be claimed now (neither it nor its provider is paused).
    pub fn claimable(&self, class: &str) -> bool {
        let Some(c) = self.classes.get(class) else { return false };
        !self.pauses.read().expect("pauses lock").blocks(class, &c.provider.name)
    }

    /// [`pause::set`] for a class or provider this deployment configures, applied on this pod at once
    /// (the others follow at their next budget sync). `None` when no such class or provider is configured.
    pub(crate) async fn set_pause(
        &self,
        db: &PgPool,
        kind: PauseKind,
        name: &str,
        paused: bool,
        actor: &crate::audit::Actor,
    ) -> Result<Option<bool>, sqlx::Error> {
        let known = match kind {
            PauseKind::Class => self.classes.contains_key(name),
            PauseKind::Provider => self.providers.contains_key(name),
        };
        if !known {
            return Ok(None);
        }
        let changed = pause::set(db, kind, name, paused, actor).await?;
        self.note_pause(kind, name, paused);
        tracing::info!(kind = kind.as_str(), name, paused, changed, actor = %actor.name, "queue pause");
        Ok(Some(changed))
    }

    /// Records a pause or resume made through this pod at once (the others read it within a sync).
    pub(crate) fn note_pause(&self, kind: PauseKind, name: &str, paused: bool) {
        self.pauses.write().expect("pauses lock").set(kind, name, paused);
        self.publish_pauses();
    }

    /// Re-reads the pauses in force (every budget sync; tests call it to apply a pause at once).
    pub async fn refresh_pauses(&self, db: &PgPool) -> Result<(), sqlx::Error> {
        let pauses = pause::load(db).await?;
        *self.pauses.write().expect("pauses lock") = pauses;
        self.publish_pauses();
        Ok(())
    }

    fn publish_pauses(&self) {
        let pauses = self.pauses();
        for class in self.classes.keys() {
            let paused = if pauses.is_paused(PauseKind::Class, class) { 1.0 } else { 0.0 };
            metrics::gauge!("cifpool_queue_paused", "kind" => "class", "name" => class.clone()).set(paused);
        }
        for provider in self.providers.keys() {
            let paused = if pauses.is_paused(PauseKind::Provider, provider) { 1.0 } else { 0.0 };
            metrics::gauge!("cifpool_queue_paused", "kind" => "provider", "name" => provider.clone()).set(paused);
        }
    }

    /// A claim stopped at a job of `provider` for want of room: its next sync asks for every worker
    /// that may send through it, and that sync runs now instead of at the next interval.
    pub(crate) fn ask_for_more(&self, provider: &str) {
        if let Some(handle) = self.providers.get(provider) {
            handle.budget.note_starved();
            self.share_wanted.notify_one();
        }
    }

    /// Reconciles this pod's share of every provider's budget once (what the budget task does every
    /// [`budget::SYNC_INTERVAL`]); tests that drive worker steps call it themselves.
    pub async fn sync_budgets(&self, db: &PgPool) {
        for handle in self.providers.values() {
            let potential = self.potential(&handle.name);
            if let Err(e) = handle.budget.sync(db, self.member, self.settings.lease, potential).await {
                tracing::debug!(provider = handle.name, error = %e, "provider budget sync failed");
            }
        }
    }

    /// Registers the providers' budgets and takes a first share of each (tests and tools that drive
    /// worker groups without [`crate::queue::worker::start_all`]).
    pub async fn join_budgets(&self, db: &PgPool) -> Result<(), sqlx::Error> {
        for handle in self.providers.values() {
            budget::register(db, &handle.budget).await?;
            handle.budget.note_starved();
        }
        self.sync_budgets(db).await;
        Ok(())
    }
}
