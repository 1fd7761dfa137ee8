//! The service's integration tests, in one crate so they compile and link once.
//!
//! Every module below tests one area against a real Postgres that [`common`] starts for this process (a
//! private cluster, a fresh database per test copied from a migrated template) and, where the area needs
//! them, running apps, `cifpool` child processes and fake providers. Run one area with
//! `cargo test --test it <module>::`, for example `cargo test --test it queue_ops::`.

mod common;

mod audit;
mod auth;
mod backpressure;
mod batch_stream;
mod budget;
mod budget_stall;
mod chaos;
mod cif_api;
mod cif_coalesce;
mod cif_config;
mod cif_holds;
mod claim_order;
mod claim_plans;
mod cli_codes;
mod cli_keys;
mod cli_queue;
mod code_check;
mod code_feistel;
mod code_ff1;
mod code_parser_fuzz;
mod code_vectors;
mod config;
mod console;
mod console_browser;
mod db_outage;
mod embedded;
mod failover;
mod fence;
mod http_basics;
mod key_rotation;
mod keys;
mod observability;
mod openapi;
mod operator_tools;
mod pool_upkeep;
mod privacy;
mod provider_failures;
mod queue;
mod queue_ops;
mod reconcile;
mod sealing;
mod shutdown;
mod sql_catalog;
mod supervision;
