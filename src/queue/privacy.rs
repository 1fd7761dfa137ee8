//! Personal data does not outlive its use. A job's recipient and payload (a phone number, an OTP code,
//! a message) are needed only until it is sent, and the API never shows them. So every statement that
//! finishes a job (sent, expired, canceled, discarded) erases the payload (and the sealed copy of both,
//! see [`crate::queue::seal`]) and masks the recipient to its last four characters, in the same
//! statement: nothing readable stays in the table, and what later dumps and backups copy holds nothing
//! either.
//!
//! A class may keep them for a stated time (`keep_personal_data`, e.g. for disputes over promotional
//! messages). The job carries its class's value from intake (`notification_jobs.keep_personal_data`);
//! the finishing statement then sets `personal_data_erase_at` instead, and the sweep erases the job's
//! data once that passes ([`crate::queue::store::erase_due`]). Dead letters keep both until someone retries or discards
//! them, since a retry needs them.

use crate::queue::status::JobStatus;

/// `SET` items that erase a finishing job's personal data now, or schedule its erasure when its class
/// keeps it. For statements that finish a job in every case.
pub(crate) const ERASE_ON_FINISH: &str = "payload = CASE WHEN keep_personal_data IS NULL THEN NULL ELSE payload END, \
     sealed = CASE WHEN keep_personal_data IS NULL THEN NULL ELSE sealed END, \
     recipient = CASE WHEN keep_personal_data IS NULL THEN notification_masked(recipient) ELSE recipient END, \
     personal_data_erase_at = clock_timestamp() + keep_personal_data";

/// [`ERASE_ON_FINISH`] for a statement whose new state is the SQL expression `state`, which may be
/// `dead`: a dead letter keeps its data for a retry.
pub(crate) fn erase_on_finish_into(state: &str) -> String {
    let dead = JobStatus::Dead.sql();
    format!(
        "payload = CASE WHEN {state} <> {dead} AND keep_personal_data IS NULL THEN NULL ELSE payload END, \
         sealed = CASE WHEN {state} <> {dead} AND keep_personal_data IS NULL THEN NULL ELSE sealed END, \
         recipient = CASE WHEN {state} <> {dead} AND keep_personal_data IS NULL \
                          THEN notification_masked(recipient) ELSE recipient END, \
         personal_data_erase_at = CASE WHEN {state} <> {dead} THEN clock_timestamp() + keep_personal_data END"
    )
}

/// Seconds a finished job of `class` keeps its payload and recipient (what intake stores with the job),
/// or `None`: erased by the statement that finishes it.
pub(crate) fn keep_seconds(class: &crate::config::ClassSettings) -> Option<f64> {
    class.keep_personal_data.filter(|d| !d.is_zero()).map(|d| d.as_secs_f64())
}

/// The recipient as support sees it and as `notification_masked` in the database makes it: the last
/// four characters of a longer one, nothing of a short one.
pub(crate) fn masked(recipient: &str) -> String {
    let n = recipient.chars().count();
    if n > 6 {
        let tail: String = recipient.chars().skip(n - 4).collect();
        format!("{}{tail}", "*".repeat(n - 4))
    } else {
        "*".repeat(n)
    }
}
