//! The facts of one request that every step of its flow needs ([`Ctx`]).

use axum::http::HeaderValue;

use crate::request::Api;

/// Request facts every step needs.
pub(crate) struct Ctx<'a> {
    pub(crate) api: Api,
    pub(crate) rid: &'a HeaderValue,
    pub(crate) auth: Option<&'a HeaderValue>,
    pub(crate) tokens: u64,
    pub(crate) stream: bool,
    /// What the routing policy matches (none under `least-loaded`).
    pub(crate) prompt: Option<crate::routing::prompt_key::PromptKey>,
}

impl Ctx<'_> {
    /// The request id as text.
    pub(crate) fn rid(&self) -> &str {
        self.rid.to_str().unwrap_or("?")
    }

    pub(crate) fn to_owned(&self) -> OwnedCtx {
        OwnedCtx {
            api: self.api,
            rid: self.rid.clone(),
            auth: self.auth.cloned(),
            tokens: self.tokens,
            stream: self.stream,
        }
    }
}

/// A [`Ctx`] that owns its headers, for a step that runs as a task of its own.
pub(crate) struct OwnedCtx {
    pub(crate) api: Api,
    pub(crate) rid: HeaderValue,
    pub(crate) auth: Option<HeaderValue>,
    pub(crate) tokens: u64,
    pub(crate) stream: bool,
}

impl OwnedCtx {
    pub(crate) fn ctx(&self) -> Ctx<'_> {
        Ctx {
            api: self.api,
            rid: &self.rid,
            auth: self.auth.as_ref(),
            tokens: self.tokens,
            stream: self.stream,
            // Only decodes run from an owned context, on a decoder already chosen.
            prompt: None,
        }
    }
}
