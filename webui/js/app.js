// The shell: who am I (GET /admin/session), the login form, the top bar and a tiny hash
// router (#/dashboard, #/settings, #/audit, #/audit/<id>, #/credentials, #/keys).

import { api, get, post, setUnauthorizedHandler } from "./api.js";
import { h, replace } from "./dom.js";
import * as dashboard from "./dashboard.js";
import * as settings from "./settings.js";
import * as audit from "./audit.js";
import * as credentials from "./credentials.js";
import * as keys from "./keys.js";

const PAGES = {
  dashboard: (main) => dashboard.mount(main),
  settings: (main) => settings.mount(main),
  audit: (main, rest) => (rest ? audit.mountDetail(main, decodeURIComponent(rest)) : audit.mount(main)),
  credentials: (main) => credentials.mount(main),
  keys: (main) => keys.mount(main),
};

const main = document.getElementById("main");
const topbar = document.getElementById("topbar");
let session = null;
let cleanup = null;

function stopPage() {
  if (typeof cleanup === "function") cleanup();
  cleanup = null;
}

function route() {
  if (!session || !session.authenticated) return;
  stopPage();
  const hash = location.hash.replace(/^#\/?/, "");
  const [page, ...rest] = hash.split("/");
  const name = PAGES[page] ? page : "dashboard";
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.page === name);
  }
  document.title = `${name[0].toUpperCase()}${name.slice(1)} · codebuddy2api`;
  main.replaceChildren();
  cleanup = PAGES[name](main, rest.join("/")) || null;
}

function showLogin(message) {
  stopPage();
  topbar.hidden = true;
  document.title = "Log in · codebuddy2api";
  const input = h("input#token", { type: "password", name: "token", autocomplete: "current-password",
                                   required: true, autofocus: true, placeholder: "admin token" });
  const error = h("p.form-error#login-error", { role: "alert", hidden: true });
  const button = h("button.primary#login-button", { type: "submit" }, "Log in");
  const form = h("form.login-card", {
    onsubmit: async (event) => {
      event.preventDefault();
      error.hidden = true;
      button.disabled = true;
      try {
        // POST /admin/login: exchanges the token for an HttpOnly session cookie (path /admin)
        session = await api("POST", "/admin/login", { token: input.value });
        input.value = "";
        await enter();
      } catch (exc) {
        replace(error, exc.status === 401 ? "That is not the admin token." : exc.message);
        error.hidden = false;
        input.select();
      } finally {
        button.disabled = false;
      }
    },
  },
  h("h1", null, "codebuddy2api"),
  h("p.muted", null, "Enter the admin token (--admin-token), or open the login URL the gateway printed "
    + "at start-up: without --admin-token it makes a new token each run."),
  message ? h("p.notice.warn", null, message) : null,
  h("label", { for: "token" }, "Admin token"),
  input,
  error,
  button);
  replace(main, h("section.login-page", null, form));
  input.focus();
}

async function enter() {
  topbar.hidden = false;
  document.getElementById("who").textContent = "signed in";
  document.getElementById("logout").hidden = false;
  if (!location.hash || location.hash === "#" || location.hash === "#/") {
    history.replaceState(null, "", "#/dashboard");
  }
  route();
}

/** The start-up login URL (/ui/?token=...): drop the token from the address bar and
 *  history at once, then exchange it for the session cookie like the form does. */
async function loginFromUrl() {
  const params = new URLSearchParams(location.search);
  const token = params.get("token");
  if (!token) return false;
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + location.hash);
  try {
    session = await api("POST", "/admin/login", { token });
    return true;
  } catch (exc) {
    showLogin(exc.status === 401 ? "That login link is not valid (a new token is made at every start)." : exc.message);
    return null;
  }
}

async function start() {
  const fromUrl = await loginFromUrl();
  if (fromUrl === null) return;
  if (!fromUrl) {
    try {
      session = await get("/admin/session");
    } catch (exc) {
      replace(main, h("p.notice.error", null, `Cannot reach the gateway: ${exc.message}`));
      return;
    }
  }
  if (session.authenticated) await enter();
  else showLogin();
}

setUnauthorizedHandler(() => {
  if (session && session.authenticated) { // once, however many calls fail
    session = { ...session, authenticated: false };
    showLogin("Your session has ended; log in again.");
  }
});

document.getElementById("logout").addEventListener("click", async () => {
  try { await post("/admin/logout"); } catch { /* the cookie is gone either way */ }
  session = { ...session, authenticated: false };
  showLogin();
});

window.addEventListener("hashchange", route);
start();
