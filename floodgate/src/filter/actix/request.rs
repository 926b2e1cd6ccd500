//! One request through the actix door: the shared stages, then the answer
//! as actix writes it (the handler's response with the rules' fields, or a
//! denial), and the give-backs a nested filter's denial calls for.

use std::rc::Rc;
use std::time::Instant;

use actix_service::Service;
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::{Error, HttpMessage};

use super::body::read_bodies;
use super::response::{deny, on_response, refuse};
use crate::filter::request::{checks, decided, guarding, lookups, Admitted, Settled};
use crate::filter::usage::Withdrawn;
use crate::filter::{Filter, Usage};
use crate::rule;

/// A request through the filter, in stages: the rules that guard it
/// ([`guarding`]), the bodies their keys read ([`read_bodies`]), each
/// rule's check ([`checks`]), the decision and what it comes to
/// ([`decided`]), and the answer: a denial ([`deny`]) or the
/// handler's ([`handled`]). A stage that refuses the request says why,
/// and [`refuse`] answers it.
pub(super) async fn filter_request<S, B>(
    filter: Filter,
    service: Rc<S>,
    mut req: ServiceRequest,
) -> Result<ServiceResponse<EitherBody<B>>, Error>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error>,
    B: MessageBody,
{
    let rules = filter.rules();
    let (matched, path) = match guarding(&filter, req.request(), &rules) {
        Ok(Some(guarded)) => guarded,
        Ok(None) => return service.call(req).await.map(|r| r.map_into_left_body()),
        Err(refused) => return Ok(refuse(req, refused)),
    };
    let bodies = match read_bodies(&filter, &mut req, &matched).await {
        Ok(bodies) => bodies,
        Err(refused) => return Ok(refuse(req, refused)),
    };
    let looked_up = lookups(&filter, req.request(), &matched).await;
    let keyed = checks(
        &filter,
        req.request(),
        &path,
        &bodies.read(),
        &looked_up,
        &matched,
    );
    drop(bodies);
    let mut checked = match keyed {
        Ok(keyed) => keyed,
        Err(refused) => return Ok(refuse(req, refused)),
    };
    let method = req.method().as_str();
    let (settled, started) = decided(&filter, matched, &mut checked, (method, &path)).await;
    match settled {
        Settled::Denied(denied) => Ok(deny(&filter, req, denied)),
        Settled::Admitted(admitted) => {
            let looked_up = (&looked_up[..], started);
            handled(&filter, &*service, req, admitted, looked_up).await
        }
    }
}

/// An admitted request: the handler answers, with the rules' fields. Units
/// go back when a filter inside denied it, or (`count = "failures"`) when
/// the answer is below 400.
async fn handled<S, B>(
    filter: &Filter,
    service: &S,
    req: ServiceRequest,
    mut admitted: Admitted<'_>,
    (looked_up, started): (&[Vec<Option<rule::Identity>>], Instant),
) -> Result<ServiceResponse<EitherBody<B>>, Error>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error>,
    B: MessageBody,
{
    let taken = admitted.record(filter, &Usage::of(req.request()), looked_up, started);
    let mut res = service.call(req).await?;
    // A filter inside denied the request: it takes nothing from ours.
    let inner_denied = res.request().extensions().get::<Withdrawn>().is_some();
    let withdrawn = inner_denied && Admitted::withdraw(filter, taken.as_ref()).await;
    admitted
        .answered(filter, res.status().as_u16(), taken.as_ref())
        .await;
    on_response(
        &mut res,
        &admitted.rules,
        &admitted.decision.outcomes,
        withdrawn,
    );
    Ok(res.map_into_left_body())
}
