"""An in-memory stand-in for the Hugging Face Hub's HTTP API, for push/pull tests on 127.0.0.1 (stdlib only).

It serves what `huggingface_hub` (create_repo, create_branch, upload_folder) and `transformers`
(from_pretrained with trust_remote_code, snapshot downloads) actually call: repo creation, branch creation,
preupload, NDJSON commits, model info, tree listings, paths-info and file resolution with the `X-Repo-Commit` /
`ETag` headers and `404 EntryNotFound` answers the clients rely on, and range requests (`Range: bytes=a-b`, answered
206 with that part: `get_safetensors_metadata` reads safetensors headers so).

What it does NOT cover, so tests using it prove nothing about these:
- LFS and Xet transfer: preupload answers "regular" for every file, so contents travel base64 inside the commit;
  the real Hub asks for LFS/Xet uploads of binaries such as *.safetensors;
- authentication and permissions (any token is accepted, `private` is ignored);
- pull requests, tags, branch deletion, server-side validation, rate limits.

Run as a script it prints its port and serves until killed (the tests start it that way).
"""

import base64
import hashlib
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


REPOS = {}  # repo_id -> {"commits": {sha: {path: bytes}}, "refs": {branch: sha}}
LOCK = threading.Lock()


def _new_sha(files):
    digest = hashlib.sha1(str(time.time_ns()).encode())
    for path in sorted(files):
        digest.update(path.encode())
        digest.update(files[path])
    return digest.hexdigest()


def _git_oid(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("fake_hub: " + (fmt % args) + "\n")

    def _send(self, code, body=b"", content_type="application/json", headers=None, head=False):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, code, kind, head=False):
        self._send(code, {"error": kind}, headers={"X-Error-Code": kind, "X-Error-Message": kind}, head=head)

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _resolve(self, repo_id, revision):
        repo = REPOS.get(repo_id)
        if repo is None:
            return None, None, None
        sha = repo["refs"].get(revision, revision if revision in repo["commits"] else None)
        return repo, sha, (repo["commits"].get(sha) if sha else None)

    def do_POST(self):
        path, body = urlparse(self.path).path, self._body()
        host = self.headers["Host"]
        if path == "/api/repos/create":
            request = json.loads(body or b"{}")
            repo_id = (request["organization"] + "/" if request.get("organization") else "") + request["name"]
            with LOCK:
                if repo_id in REPOS:  # create_repo(exist_ok=True) reads "url" from the 409 body
                    return self._send(409, {"error": "You already created this model repo",
                                            "url": f"http://{host}/{repo_id}"})
                sha = _new_sha({})
                REPOS[repo_id] = {"commits": {sha: {}}, "refs": {"main": sha}}
            return self._send(200, {"url": f"http://{host}/{repo_id}", "name": repo_id, "id": repo_id})
        if path == "/api/validate-yaml":
            return self._send(200, {"errors": [], "warnings": []})
        if match := re.match(r"^/api/models/(.+?)/branch/(.+)$", path):
            repo_id, branch = match.group(1), unquote(match.group(2))
            with LOCK:
                repo = REPOS.get(repo_id)
                if repo is None:
                    return self._error(404, "RepoNotFound")
                if branch in repo["refs"]:
                    return self._send(409, {"error": "Reference already exists"})
                repo["refs"][branch] = repo["refs"]["main"]
            return self._send(200, {})
        if re.match(r"^/api/models/(.+?)/preupload/(.+)$", path):
            files = json.loads(body)["files"]
            return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
        if match := re.match(r"^/api/models/(.+?)/commit/(.+)$", path):
            repo_id, revision = match.group(1), unquote(match.group(2))
            with LOCK:
                repo, sha, files = self._resolve(repo_id, revision)
                if repo is None:
                    return self._error(404, "RepoNotFound")
                if files is None:
                    return self._error(404, "RevisionNotFound")
                new_files = dict(files)
                for line in body.decode().splitlines():
                    if not line.strip():
                        continue
                    operation = json.loads(line)
                    if operation["key"] == "file":
                        new_files[operation["value"]["path"]] = base64.b64decode(operation["value"]["content"])
                    elif operation["key"] in ("deletedFile", "deletedFolder"):
                        prefix = operation["value"]["path"]
                        new_files = {k: v for k, v in new_files.items()
                                     if k != prefix and not k.startswith(prefix.rstrip("/") + "/")}
                    elif operation["key"] == "lfsFile":
                        return self._send(400, {"error": "LFS is not supported by the fake hub"})
                new_sha = _new_sha(new_files)
                repo["commits"][new_sha] = new_files
                branch = revision if revision in repo["refs"] else "main"
                repo["refs"][branch] = new_sha
            return self._send(200, {"commitUrl": f"http://{host}/{repo_id}/commit/{new_sha}", "commitOid": new_sha,
                                    "pullRequestUrl": None})
        if match := re.match(r"^/api/models/(.+?)/paths-info/(.+)$", path):
            _, _, files = self._resolve(match.group(1), unquote(match.group(2)))
            if files is None:
                return self._error(404, "RepoNotFound")
            if body and not body.startswith(b"{"):
                wanted = parse_qs(body.decode()).get("paths", [])
            else:
                wanted = json.loads(body or b"{}").get("paths", [])
            return self._send(200, [{"type": "file", "path": p, "oid": _git_oid(files[p]), "size": len(files[p])}
                                    for p in wanted if p in files])
        return self._error(404, "NotFound")

    def _get_or_head(self, head):
        path = urlparse(self.path).path
        if path == "/api/whoami-v2":
            return self._send(200, {"type": "user", "name": "tester", "orgs": [],
                                    "auth": {"accessToken": {"role": "write"}}}, head=head)
        if (match := re.match(r"^/api/models/(.+?)(?:/revision/(.+))?$", path)) and "/tree/" not in path:
            repo, sha, files = self._resolve(match.group(1), unquote(match.group(2) or "main"))
            if repo is None or sha is None:
                return self._error(404, "RepoNotFound", head)
            return self._send(200, {"id": match.group(1), "modelId": match.group(1), "sha": sha, "private": False,
                                    "tags": [], "siblings": [{"rfilename": p} for p in sorted(files)]}, head=head)
        if match := re.match(r"^/api/models/(.+?)/tree/([^/]+)(?:/(.*))?$", path):
            _, _, files = self._resolve(match.group(1), unquote(match.group(2)))
            if files is None:
                return self._error(404, "RepoNotFound", head)
            prefix = (match.group(3) or "").strip("/")
            return self._send(200, [{"type": "file", "path": p, "oid": _git_oid(b), "size": len(b)}
                                    for p, b in sorted(files.items()) if not prefix or p.startswith(prefix + "/")],
                              head=head)
        if match := re.match(r"^/(.+?)/resolve/([^/]+)/(.+)$", path):
            repo, sha, files = self._resolve(match.group(1), unquote(match.group(2)))
            if repo is None:
                return self._error(404, "RepoNotFound", head)
            if files is None:
                return self._error(404, "RevisionNotFound", head)
            file_path = unquote(match.group(3))
            if file_path not in files:
                return self._send(404, b"", headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, head=head)
            data, headers = files[file_path], {"X-Repo-Commit": sha, "ETag": '"%s"' % _git_oid(files[file_path])}
            if requested := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or ""):
                # A range request (how safetensors headers are read): the part asked for
                first = int(requested.group(1))
                last = min(int(requested.group(2) or len(data) - 1), len(data) - 1)
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                return self._send(206, data[first : last + 1], content_type="application/octet-stream",
                                  headers=headers, head=head)
            return self._send(200, data, content_type="application/octet-stream", headers=headers, head=head)
        return self._error(404, "NotFound", head)

    def do_GET(self):
        self._get_or_head(False)

    def do_HEAD(self):
        self._get_or_head(True)


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0), FakeHubHandler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
