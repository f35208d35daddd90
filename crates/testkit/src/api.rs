//! One broker's management API over HTTP: the client the test fixtures and [`mgmt`](crate::mgmt)
//! share. Knows nothing of the test broker (that is [`mgmt`](crate::mgmt), which sets it up
//! through [`fixtures`](crate::fixtures) first).

use crate::START_BROKER;

/// The management API of one broker: its base URL and the `Authorization` header value.
#[derive(Clone)]
pub struct Client {
    base: String,
    auth: String,
}

/// Without the `Authorization` value: it is the password, base64-encoded.
impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("auth", &"***")
            .finish()
    }
}

impl Client {
    /// The API at `base`, e.g. `http://127.0.0.1:15672` or `http://user:pass@host:15672`.
    /// Credentials in the URL win; otherwise `RABBITMQ_MGMT_USER` / `RABBITMQ_MGMT_PASSWORD`
    /// (default `guest`/`guest`).
    pub fn new(base: &str) -> Self {
        let base = base.trim_end_matches('/');
        let (scheme, rest) = base.split_once("://").unwrap_or(("http", base));
        let (credentials, host) = match rest.rsplit_once('@') {
            Some((cred, host)) => (cred.to_owned(), host),
            None => {
                let user = std::env::var("RABBITMQ_MGMT_USER").unwrap_or_else(|_| "guest".into());
                let pass =
                    std::env::var("RABBITMQ_MGMT_PASSWORD").unwrap_or_else(|_| "guest".into());
                (format!("{user}:{pass}"), rest)
            }
        };
        Self {
            base: format!("{scheme}://{host}"),
            auth: format!("Basic {}", base64(credentials.as_bytes())),
        }
    }

    /// The base URL, without credentials.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The `Authorization` header value it sends.
    pub fn authorization(&self) -> &str {
        &self.auth
    }

    /// `GET {base}{path}` as JSON; the error says how to get the API running.
    pub fn get_json(&self, path: &str) -> Result<serde_json::Value, String> {
        let url = format!("{}{path}", self.base);
        let mut resp = ureq::get(&url)
            .header("Authorization", &self.auth)
            .call()
            .map_err(|e| format!("management API {url}: {e}\n{START_BROKER}"))?;
        resp.body_mut()
            .read_json::<serde_json::Value>()
            .map_err(|e| format!("decoding {url}: {e}"))
    }

    /// `POST {base}{path}` with a JSON body; the JSON answer.
    pub fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, String> {
        let url = format!("{}{path}", self.base);
        let mut resp = ureq::post(&url)
            .header("Authorization", &self.auth)
            .send_json(body)
            .map_err(|e| format!("POST {url}: {e}\n{START_BROKER}"))?;
        resp.body_mut()
            .read_json::<serde_json::Value>()
            .map_err(|e| format!("decoding {url}: {e}"))
    }

    /// `DELETE {base}{path}`: `Ok(false)` when there was nothing to delete (404).
    pub fn delete(&self, path: &str) -> Result<bool, String> {
        let url = format!("{}{path}", self.base);
        match ureq::delete(&url)
            .header("Authorization", &self.auth)
            .call()
        {
            Ok(_) => Ok(true),
            Err(ureq::Error::StatusCode(404)) => Ok(false),
            Err(e) => Err(format!("DELETE {url}: {e}")),
        }
    }

    /// The version the broker reports (`/api/overview`).
    pub fn version(&self) -> Result<String, String> {
        let v = self.get_json("/api/overview")?;
        v["rabbitmq_version"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("no rabbitmq_version in /api/overview: {v}"))
    }

    /// Names of the `kind` (`"queues"`, `"exchanges"`) objects starting with `prefix`.
    pub fn names_with_prefix(&self, kind: &str, prefix: &str) -> Result<Vec<String>, String> {
        let list = self.get_json(&format!("/api/{kind}/%2f?columns=name"))?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|item| item["name"].as_str())
            .filter(|name| name.starts_with(prefix))
            .map(str::to_owned)
            .collect())
    }

    /// Deletes every queue and exchange whose name starts with `prefix`; returns their names.
    /// A failed delete of one object does not stop the others.
    pub fn delete_prefix(&self, prefix: &str) -> Result<Vec<String>, String> {
        let mut deleted = Vec::new();
        for kind in ["queues", "exchanges"] {
            for name in self.names_with_prefix(kind, prefix)? {
                if let Ok(true) = self.delete(&format!("/api/{kind}/%2f/{}", pct(&name))) {
                    deleted.push(name);
                }
            }
        }
        Ok(deleted)
    }

    /// Management names of the connections whose client property `connection_name` is `name`.
    pub fn connections_named(&self, name: &str) -> Result<Vec<String>, String> {
        let list = self.get_json("/api/connections?columns=name,client_properties")?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["client_properties"]["connection_name"].as_str() == Some(name))
            .filter_map(|c| c["name"].as_str().map(str::to_owned))
            .collect())
    }

    /// Force-closes the connection whose management name is `mgmt_name` (as the broker would);
    /// `Ok(false)` when it was already gone.
    pub fn close_connection(&self, mgmt_name: &str) -> Result<bool, String> {
        let url = format!("{}/api/connections/{}", self.base, pct(mgmt_name));
        match ureq::delete(&url)
            .header("Authorization", &self.auth)
            .header("X-Reason", "closed by a redeliver test")
            .call()
        {
            Ok(_) => Ok(true),
            Err(ureq::Error::StatusCode(404)) => Ok(false),
            Err(e) => Err(format!("DELETE {url}: {e}")),
        }
    }
}

fn base64(input: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(input)
}

/// Percent-encodes one path segment (a queue, exchange or connection name): everything but
/// RFC 3986's unreserved characters.
pub fn pct(s: &str) -> String {
    use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
    const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    utf8_percent_encode(s, SEGMENT).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_from_the_url_when_it_has_them() {
        let c = Client::new("http://admin:s3cret@127.0.0.1:15672/");
        assert_eq!(c.base(), "http://127.0.0.1:15672");
        assert_eq!(c.auth, format!("Basic {}", base64(b"admin:s3cret")));
        assert_eq!(base64(b"guest:guest"), "Z3Vlc3Q6Z3Vlc3Q=");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(pct("rd-1.q_~ x/y%"), "rd-1.q_~%20x%2Fy%25");
        assert_eq!(pct("a.b c/d"), "a.b%20c%2Fd");
    }

    #[test]
    fn debug_hides_the_credentials() {
        let c = Client::new("http://admin:s3cret@127.0.0.1:15672/");
        let shown = format!("{c:?}");
        assert!(shown.contains("127.0.0.1:15672"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(!shown.contains(&base64(b"admin:s3cret")), "{shown}");
    }
}
