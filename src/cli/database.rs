//! The commands that work on the database directly, as an operator would without the HTTP API:
//! `cifpool queue`, `keys`, `audit` and `dlq`.

use clap::{Args, Subcommand};

use super::runtime;
use crate::config::Settings;
use crate::db::Database;
use crate::queue::Queue;

/// `cifpool queue …`
#[derive(Debug, Subcommand)]
pub enum QueueCommand {
    /// Stop every pod claiming a class's jobs (or, for a provider, the jobs of every class it sends)
    /// within a second; sends in flight finish and intake goes on accepting.
    Pause {
        /// class or provider.
        #[arg(value_enum)]
        kind: crate::queue::pause::PauseKind,
        /// Its configured name.
        name: String,
    },
    /// Undo a pause: every pod claims again within a second.
    Resume {
        /// class or provider.
        #[arg(value_enum)]
        kind: crate::queue::pause::PauseKind,
        /// Its configured name.
        name: String,
    },
    /// List the pauses in force (one JSON object per line: kind, name, since when, by whom).
    Pauses,
    /// Cancel every job of a batch that is not being sent yet; prints how many were canceled.
    CancelBatch {
        /// The batch id `POST /v1/notifications/batch` answered.
        id: i64,
    },
    /// Erase what the service holds of one recipient (a customer's erasure request): waiting jobs are
    /// canceled, dead letters discarded, finished jobs' kept data erased. Reads and opens every job
    /// still holding personal data; prints the counts as JSON. Needs the master key.
    EraseRecipient {
        /// The phone number, device token, … exactly as it was enqueued.
        recipient: String,
        /// Only this tenant's jobs.
        #[arg(long)]
        tenant: Option<String>,
        /// Make the changes (without it, only count).
        #[arg(long)]
        apply: bool,
    },
}

/// `cifpool keys …`
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key and print its secret once (it is not stored; keep it in your secret store).
    Create {
        /// Unique name, 1-64 characters of A-Z a-z 0-9 . _ : - (the actor in the audit trail).
        name: String,
        /// Scopes: cif:reserve, cif:read, notify:send, notify:read, admin (comma-separated).
        #[arg(long, value_delimiter = ',', required = true)]
        scopes: Vec<String>,
        /// Tenants the key may act for (comma-separated); leave out for a trusted service.
        #[arg(long, value_delimiter = ',')]
        tenants: Option<Vec<String>>,
    },
    /// List every key (names, scopes, tenants, use and revocation; never secrets).
    List,
    /// Revoke a key: every pod refuses it within 5 seconds.
    Revoke {
        /// The key's name.
        name: String,
    },
}

/// `cifpool audit …`: the filters of `GET /admin/audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Only events of this code.
    #[arg(long)]
    pub cif: Option<String>,
    /// Only events carrying this customer reference.
    #[arg(long)]
    pub customer_ref: Option<String>,
    /// Only events by this actor (a key name, bootstrap, system, cli:USER).
    #[arg(long)]
    pub actor: Option<String>,
    /// Only events of this action, e.g. cif.confirmed.
    #[arg(long)]
    pub action: Option<String>,
    /// Only events at or after this RFC 3339 time.
    #[arg(long)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events before this RFC 3339 time.
    #[arg(long)]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Most events to print.
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
}

/// `cifpool dlq …`
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead jobs, oldest first.
    List {
        #[command(flatten)]
        filter: DlqArgs,
        /// Most rows to print.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Put dead jobs back in the queue at a bounded rate.
    Replay {
        #[command(flatten)]
        filter: DlqArgs,
        /// Most jobs to replay.
        #[arg(long)]
        max: i64,
        /// Jobs per second they become due at.
        #[arg(long, default_value_t = 10.0)]
        rate: f64,
        /// Extra attempts each job gets.
        #[arg(long, default_value_t = 1)]
        extra_attempts: i32,
    },
    /// Put one dead job back in the queue, due now; prints the job.
    Retry {
        /// The job's id.
        id: i64,
        /// Extra attempts it gets.
        #[arg(long, default_value_t = 1)]
        extra_attempts: i32,
    },
    /// Mark one dead job discarded (never sent, kept with its history); prints the job.
    Discard {
        /// The job's id.
        id: i64,
    },
}

/// Dead-letter filter flags.
#[derive(Debug, Args)]
pub struct DlqArgs {
    /// Only this class.
    #[arg(long)]
    pub class: Option<String>,
    /// Only this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only jobs whose last error contains this text.
    #[arg(long)]
    pub error: Option<String>,
}

impl DlqArgs {
    fn filter(&self) -> crate::queue::dlq::DlqFilter {
        crate::queue::dlq::DlqFilter {
            class: self.class.clone(),
            tenant: self.tenant.clone(),
            error: self.error.clone(),
        }
    }
}

/// Runs `work` on the configured database (migrated first: the commands need the tables of this build).
pub(super) fn with_database<F>(settings: &Settings, work: F) -> anyhow::Result<()>
where
    F: for<'a> FnOnce(
        &'a sqlx::PgPool,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + 'a>>,
{
    runtime()?.block_on(async {
        let database = Database::open(settings).await?;
        let result = match crate::db::migrate(&database.pool).await {
            Ok(()) => work(&database.pool).await,
            Err(e) => Err(anyhow::Error::new(e).context("applying migrations")),
        };
        database.close().await;
        result
    })
}

/// The queue's operations on `db` as `serve` offers them, for the configured classes and providers
/// (nothing started: no worker, schedule or listener). Jobs' personal data opens with a key derived
/// from the master key, so these commands need it too.
pub(super) fn queue_service(db: &sqlx::PgPool, settings: &Settings) -> anyhow::Result<Queue> {
    let master = crate::config::master_key::resolve_master_key(settings, false)?;
    let seal = crate::queue::seal::Seal::from_settings(&master, &settings.security);
    let runtime = crate::queue::runtime::QueueRuntime::new(settings.queue.clone(), seal);
    Ok(Queue::new(db.clone(), runtime, Default::default(), tokio_util::task::TaskTracker::new()))
}

pub(super) async fn run_keys(db: &sqlx::PgPool, command: KeysCommand) -> anyhow::Result<()> {
    use crate::auth::api_key::NewKey;
    // Keys are managed without the bootstrap token: the command line is not a request.
    let keys = crate::auth::Authenticator::new(db.clone(), None, tokio_util::task::TaskTracker::new());
    let actor = crate::audit::Actor::cli();
    match command {
        KeysCommand::Create { name, scopes, tenants } => {
            let created = keys.create_key(&actor, &NewKey { name, scopes, tenants }).await?;
            println!("{}", serde_json::to_string(&created)?);
            eprintln!("the key is shown this once: store it now");
        }
        KeysCommand::List => {
            for key in keys.keys().await? {
                println!("{}", serde_json::to_string(&key)?);
            }
        }
        KeysCommand::Revoke { name } => {
            keys.revoke_key(&actor, &name).await?;
            eprintln!("revoked {name}: every pod refuses it within 5 s");
        }
    }
    Ok(())
}

pub(super) async fn run_audit(db: &sqlx::PgPool, args: AuditArgs) -> anyhow::Result<()> {
    let query = crate::audit::AuditQuery {
        cif: args.cif,
        customer_ref: args.customer_ref,
        actor: args.actor,
        action: args.action,
        since: args.since,
        until: args.until,
        cursor: None,
        limit: Some(args.limit),
    };
    query.validate().map_err(|e| anyhow::anyhow!(e))?;
    for event in crate::audit::AuditTrail::new(db.clone()).search(&query).await?.events {
        println!("{}", serde_json::to_string(&event)?);
    }
    Ok(())
}

pub(super) async fn run_queue(queue: &Queue, command: QueueCommand) -> anyhow::Result<()> {
    use crate::queue::pause::PauseKind;
    let actor = &crate::audit::Actor::cli();
    let set = |kind: PauseKind, name: String, paused: bool| async move {
        let changed = queue.set_pause(kind, &name, paused, actor).await?;
        let Some(changed) = changed else {
            anyhow::bail!("no {} named {name:?} in the configuration", kind.as_str());
        };
        let state = if paused { "paused" } else { "resumed" };
        if changed {
            eprintln!("{} {name} {state}: every pod follows within 1 s", kind.as_str());
        } else {
            eprintln!("{} {name} was already {state}", kind.as_str());
        }
        anyhow::Ok(())
    };
    match command {
        QueueCommand::Pause { kind, name } => set(kind, name, true).await?,
        QueueCommand::Resume { kind, name } => set(kind, name, false).await?,
        QueueCommand::Pauses => {
            for row in queue.pauses().await? {
                println!("{}", serde_json::to_string(&row)?);
            }
        }
        QueueCommand::CancelBatch { id } => {
            let batch = queue.batch_for_operator(id).await?.ok_or_else(|| anyhow::anyhow!("no batch {id}"))?;
            let canceled = queue.cancel_batch(batch, actor.clone()).await?;
            println!("{}", serde_json::json!({ "batch_id": id, "canceled": canceled }));
        }
        QueueCommand::EraseRecipient { recipient, tenant, apply } => {
            let report = queue.erase_recipient(&recipient, tenant.as_deref(), apply, actor).await?;
            println!("{}", serde_json::to_string(&report)?);
            if !apply && report.matched > 0 {
                eprintln!("dry run: nothing was changed; run again with --apply to erase");
            }
        }
    }
    Ok(())
}

pub(super) async fn run_dlq(queue: &Queue, command: DlqCommand) -> anyhow::Result<()> {
    use crate::queue::dlq;
    match command {
        DlqCommand::List { filter, limit } => {
            let filter = filter.filter();
            filter.validate().map_err(|e| anyhow::anyhow!(e))?;
            anyhow::ensure!(limit >= 1, "--limit must be at least 1");
            for job in queue.dead_letters(&filter, limit).await? {
                println!("{}", serde_json::to_string(&job)?);
            }
        }
        DlqCommand::Replay { filter, max, rate, extra_attempts } => {
            let replay = dlq::Replay { filter: filter.filter(), max, rate_per_sec: rate, extra_attempts };
            replay.validate().map_err(|e| anyhow::anyhow!(e))?;
            let n = queue.replay(&replay, &crate::audit::Actor::cli()).await?;
            println!("replayed {n} jobs at {rate}/s");
        }
        DlqCommand::Retry { id, extra_attempts } => {
            anyhow::ensure!(
                (1..=dlq::MAX_EXTRA_ATTEMPTS).contains(&extra_attempts),
                "--extra-attempts must be between 1 and {}",
                dlq::MAX_EXTRA_ATTEMPTS
            );
            let done = queue.retry_dead_letter(id, extra_attempts, &crate::audit::Actor::cli()).await?;
            print_dead_letter_action(id, done)?;
        }
        DlqCommand::Discard { id } => {
            let done = queue.discard_dead_letter(id, &crate::audit::Actor::cli()).await?;
            print_dead_letter_action(id, done)?;
        }
    }
    Ok(())
}

fn print_dead_letter_action(id: i64, done: crate::queue::dlq::DeadLetterAction) -> anyhow::Result<()> {
    use crate::queue::dlq::DeadLetterAction;
    match done {
        DeadLetterAction::Done(job) => {
            println!("{}", serde_json::to_string(&job)?);
            Ok(())
        }
        DeadLetterAction::NotDead(status) => anyhow::bail!("job {id} is {status}, not a dead letter"),
        DeadLetterAction::NotFound => anyhow::bail!("no job {id}"),
    }
}
