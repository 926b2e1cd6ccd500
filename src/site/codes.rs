//! The SMS codes of the sign-in and reset flows: texting one, and what the
//! form says when one does not check out.

use std::sync::Arc;

use super::phone::Phone;
use super::store::{CodeCheck, Purpose, CODE_TTL_SECS, MAX_ATTEMPTS};
use super::{Site, SiteError};

/// Issues a new `purpose` code for `phone` (replacing any earlier one),
/// bound to the session `sid` that asked for it, and texts it. A reset
/// code is texted only when the phone has an account, but the Redis work
/// is the same either way, so the answer tells nothing.
pub(super) async fn text_code(
    site: &Site,
    purpose: Purpose,
    phone: &Phone,
    sid: &str,
) -> Result<(), SiteError> {
    let (store, sms) = (site.store.clone(), Arc::clone(&site.sms));
    let (to, sid) = (phone.clone(), sid.to_string());
    site.redis(move |conn| {
        let send = match purpose {
            Purpose::SignIn => true,
            Purpose::Reset => store.account(conn, &to)?.is_some(),
        };
        let code = store.issue_code(conn, purpose, &to, &sid)?;
        if !send {
            return Ok(());
        }
        let minutes = CODE_TTL_SECS / 60;
        let text = match purpose {
            Purpose::SignIn => {
                format!("Your floodgate sign-in code is {code}. It expires in {minutes} minutes.")
            }
            Purpose::Reset => format!(
                "Your floodgate password reset code is {code}. It expires in {minutes} minutes. If you did not ask for it, ignore this message."
            ),
        };
        sms.send(conn, &to, &text)
    })
    .await
}

/// What the form says about a code that did not check out.
pub(super) fn code_error(check: CodeCheck) -> String {
    match check {
        CodeCheck::Wrong(0) => format!(
            "That code is not right, and after {MAX_ATTEMPTS} wrong tries it no longer works. Ask for a new code."
        ),
        CodeCheck::Wrong(1) => "That code is not right. You have 1 more try.".into(),
        CodeCheck::Wrong(n) => format!("That code is not right. You have {n} more tries."),
        CodeCheck::Missing | CodeCheck::Valid => {
            "There is no valid code for this number: it was used, it expired, or none was sent. Ask for a new code.".into()
        }
    }
}
