// Same-origin JSON calls to the admin API. State-changing requests are ordinary fetches
// from this page, so the browser sends our own Origin (the server checks it when the
// session cookie is what authenticates the call).

export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || null;
    this.param = err.param || null;
    this.body = body;
  }
}

let onUnauthorized = () => {};

/** Called with no arguments whenever the admin API says the session is gone (401). */
export function setUnauthorizedHandler(fn) {
  onUnauthorized = fn;
}

/** options.timeoutMs: give up after that long (an unreachable gateway can leave a fetch hanging);
 *  the failure is status 0, like a refused connection. */
export async function api(method, path, body, options = {}) {
  const init = { method, credentials: "same-origin", headers: { accept: "application/json" } };
  if (options.timeoutMs) init.signal = AbortSignal.timeout(options.timeoutMs);
  if (body !== undefined) {
    init.headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (exc) {
    throw new ApiError(0, { error: { code: "network", message: `cannot reach the gateway (${exc.message})` } });
  }
  let payload = null;
  let text;
  try {
    text = await response.text();
  } catch (exc) { // cut or timed out while the body was read
    throw new ApiError(0, { error: { code: "network", message: `cannot reach the gateway (${exc.message})` } });
  }
  if (text) {
    try { payload = JSON.parse(text); } catch { payload = { error: { message: text.slice(0, 300) } }; }
  }
  if (!response.ok) {
    const error = new ApiError(response.status, payload);
    if (response.status === 401 && path.startsWith("/admin/api/")) onUnauthorized();
    throw error;
  }
  return payload;
}

export const get = (path, options) => api("GET", path, undefined, options);
export const post = (path, body) => api("POST", path, body === undefined ? {} : body);
export const put = (path, body) => api("PUT", path, body);
// a JSON body: the admin surface wants application/json on every state-changing request
export const del = (path) => api("DELETE", path, {});

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}
