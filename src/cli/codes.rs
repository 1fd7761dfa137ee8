//! `cifpool codes gen|inspect`: the pure code generator from the command line (no database: a
//! pool's later key epochs are given with `--epoch`).

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::config::Settings;

/// `cifpool codes …`
#[derive(Debug, Subcommand)]
pub enum CodesCommand {
    /// Print the codes for counters START..START+COUNT, one per line.
    Gen {
        #[command(flatten)]
        format: CodeArgs,
        /// First counter.
        #[arg(long, default_value_t = 0)]
        start: u64,
        /// How many codes.
        #[arg(long)]
        count: u64,
    },
    /// Print the counter a code was generated from, or why the code is malformed.
    Inspect {
        #[command(flatten)]
        format: CodeArgs,
        /// The code to inspect.
        code: String,
    },
}

/// Which permutation and format: from flags, or from a configured pool (`--pool`), flags winning.
#[derive(Debug, Args)]
pub struct CodeArgs {
    /// Scrambled digits per code (6-18). Defaults to the pool's.
    #[arg(long)]
    pub digits: Option<u32>,
    /// Leading digits (0-6). Defaults to the pool's, else none.
    #[arg(long)]
    pub prefix: Option<String>,
    /// Check-digit scheme: damm, luhn, mod97 or none. Defaults to the pool's, else damm.
    #[arg(long)]
    pub check: Option<crate::code::check::CheckScheme>,
    /// Master key in hex, on the command line (other users see it in `ps`, and shells keep it in their
    /// history: prefer --key-stdin, or the CIFPOOL_MASTER_KEY environment variable). Without either, the
    /// configured master key (CIFPOOL_MASTER_KEY, security.master_key_file, the dev key).
    #[arg(long, value_name = "HEX", conflicts_with = "key_stdin")]
    pub key_hex: Option<String>,
    /// Read the master key in hex from the first line of standard input (e.g. `vault read … | cifpool
    /// codes inspect --key-stdin CODE`).
    #[arg(long)]
    pub key_stdin: bool,
    /// Key label of the pool. Defaults to the pool's, else "default".
    #[arg(long)]
    pub key_id: Option<String>,
    /// Pool name (part of the key derivation, and FF1's tweak); a configured pool also supplies format,
    /// key id and cipher.
    #[arg(long, value_name = "NAME")]
    pub pool: Option<String>,
    /// The keyed permutation. Defaults to the configured pool's; without a configured pool, `feistel`
    /// (the cipher of every code issued before FF1 was offered).
    #[arg(long, value_enum)]
    pub cipher: Option<crate::code::cipher::Cipher>,
    /// A key epoch the pool started after the configured key (`cifpool pools rotate-key`), as
    /// KEY_ID@FIRST_COUNTER, oldest first; repeat for each (`cifpool pools locate` reads them from the
    /// database instead).
    #[arg(long = "epoch", value_name = "KEY_ID@FIRST_COUNTER")]
    pub epochs: Vec<String>,
}

impl CodeArgs {
    /// The key epochs these arguments describe: the pool's configured key, then each `--epoch`.
    pub fn keys(&self, settings: &Settings) -> anyhow::Result<crate::cif::epochs::KeyEpochs> {
        use crate::cif::epochs::{KeyEpoch, KeyEpochs};
        use crate::code::cipher::Cipher;
        use crate::code::format::{CodeFormat, PoolCodec};
        let configured = match &self.pool {
            Some(name) => settings.pool(name),
            None => None,
        };
        if self.pool.is_some() && configured.is_none() && self.key_hex.is_none() && !self.key_stdin {
            anyhow::bail!(
                "pool {:?} is not in the configuration; pass the key (--key-stdin or --key-hex) and the format flags",
                self.pool.as_deref().unwrap_or_default()
            );
        }
        let digits = self
            .digits
            .or(configured.map(|p| p.digits))
            .ok_or_else(|| anyhow::anyhow!("--digits is required unless --pool names a configured pool"))?;
        let prefix = self.prefix.clone().or(configured.map(|p| p.prefix.clone())).unwrap_or_default();
        let check = self.check.or(configured.map(|p| p.check)).unwrap_or_default();
        let key_id = self.key_id.clone().or(configured.map(|p| p.key_id.clone())).unwrap_or_else(|| "default".into());
        let pool_name = self.pool.clone().unwrap_or_else(|| "default".into());
        let cipher = match (self.cipher, configured) {
            (Some(cipher), _) => cipher,
            (None, Some(pool)) => pool.cipher.ok_or_else(|| {
                anyhow::anyhow!(
                    "pool {pool_name:?} does not name its cipher in the configuration (the database pins it: \
                     SELECT cipher FROM cif_pools WHERE name = '{pool_name}'); pass --cipher ff1 or --cipher feistel"
                )
            })?,
            (None, None) => Cipher::Feistel,
        };
        let master = match &self.key_hex {
            Some(hex) => crate::keys::MasterKey::from_hex(hex).context("--key-hex")?,
            None if self.key_stdin => {
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).context("reading the key from standard input")?;
                let key = crate::keys::MasterKey::from_hex(&line).context("--key-stdin");
                line.replace_range(.., &"0".repeat(line.len()));
                key?
            }
            None => crate::config::master_key::resolve_master_key(settings, false)?,
        };
        let format = CodeFormat::new(prefix, digits, check)?;
        let codec = |key_id: &str| {
            PoolCodec::with_cipher(format.clone(), cipher, &master.derive_pool_key(&pool_name, key_id), &pool_name)
        };
        let mut epochs = vec![KeyEpoch { number: 0, key_id: key_id.clone(), first_counter: 0, codec: codec(&key_id)? }];
        for (i, epoch) in self.epochs.iter().enumerate() {
            let (key_id, first) = epoch
                .rsplit_once('@')
                .and_then(|(id, first)| Some((id, first.parse::<u64>().ok()?)))
                .filter(|(id, _)| !id.is_empty())
                .ok_or_else(|| anyhow::anyhow!("--epoch {epoch:?}: expected KEY_ID@FIRST_COUNTER"))?;
            let previous = epochs.last().map_or(0, |e| e.first_counter);
            anyhow::ensure!(first >= previous, "--epoch {epoch:?}: epochs go oldest first, each from a later counter");
            epochs.push(KeyEpoch {
                number: i as i16 + 1,
                key_id: key_id.to_string(),
                first_counter: first,
                codec: codec(key_id)?,
            });
        }
        Ok(KeyEpochs::new(epochs))
    }
}
