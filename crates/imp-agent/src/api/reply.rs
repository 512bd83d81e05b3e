//! What every answer of the API is made of: its body type and the Kubernetes `Status` of a
//! failed request.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, UPGRADE};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

use super::EXEC_UPGRADE;

/// The body of every response.
pub type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// A Kubernetes `Status` answering a failed request.
pub(super) fn status(code: StatusCode, message: &str) -> Response<Body> {
    let body = imp_agent_api::status_body(code, message);
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *resp.status_mut() = code;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if code == StatusCode::UPGRADE_REQUIRED {
        resp.headers_mut()
            .insert(UPGRADE, HeaderValue::from_static(EXEC_UPGRADE));
    }
    resp
}
